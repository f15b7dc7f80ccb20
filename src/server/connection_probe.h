// Whether the HTTP client of a request is still connected.
//
// cpp-httplib 0.11 (Debian's) gives handlers neither the socket nor a
// "connection closed" test, and a client that gives up on a long
// non-streaming request must still cancel its sequence so its KV blocks come
// back. The handler knows the connection's addresses (remote_addr,
// remote_port, local_port); ConnectionProbe finds this process's socket with
// exactly those endpoints and watches it for end-of-file. The socket stays
// valid while the handler runs: httplib closes it only after the handler
// returns.
//
// The same search closes a stopped server's idle keep-alive connections
// (shutdown_all).
//
// Linux-specific (/proc/self/fd). When no socket matches, the probe is
// invalid and closed() is always false (streams still notice a failed write).
//
// Thread safety: one probe per handler thread.
#pragma once

#include <string>

namespace kvserve {

class ConnectionProbe {
 public:
  ConnectionProbe() = default;
  // The connected TCP socket whose peer is (remote_addr, remote_port) and
  // whose local port is local_port.
  static ConnectionProbe find(const std::string& remote_addr, int remote_port, int local_port);

  // Shuts down (both directions) every connected TCP socket of this process
  // whose local port is local_port: a server's idle keep-alive connections,
  // which httplib would otherwise hold open for their whole keep-alive
  // timeout after the server stops. Returns how many.
  static int shutdown_all(int local_port);

  bool valid() const { return fd_ >= 0; }
  // True once the peer has closed its side or the connection failed. Never
  // blocks and never consumes data.
  bool closed() const;
  // Shuts the connection down in both directions now: httplib must not
  // parse what the client sends next (the rest of a body it gave up
  // reading, of which its stream buffer may already hold a part).
  void shut_down() const;

 private:
  explicit ConnectionProbe(int fd) : fd_(fd) {}
  int fd_ = -1;  // borrowed from httplib; never closed here
};

}  // namespace kvserve
