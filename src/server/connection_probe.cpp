#include "server/connection_probe.h"

#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace kvserve {
namespace {

// The numeric host and the port of a socket address; false for non-IP families.
bool numeric_endpoint(const sockaddr_storage& addr, socklen_t len, std::string* host, int* port) {
  if (addr.ss_family != AF_INET && addr.ss_family != AF_INET6) return false;
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, h, sizeof(h), p, sizeof(p),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  *host = h;
  *port = std::atoi(p);
  return true;
}

// Calls f(fd, peer host, peer port, local port) for every connected IP socket
// of this process until f returns true.
template <class F>
void for_each_connection(F&& f) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || fd < 0 || fd == dirfd(dir)) continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_len = sizeof(peer), local_len = sizeof(local);
    if (getpeername(int(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) continue;  // not a connected socket
    if (getsockname(int(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0) continue;
    std::string peer_host, local_host;
    int peer_port = 0, port = 0;
    if (!numeric_endpoint(peer, peer_len, &peer_host, &peer_port)) continue;
    if (!numeric_endpoint(local, local_len, &local_host, &port)) continue;
    if (f(int(fd), peer_host, peer_port, port)) break;
  }
  closedir(dir);
}

}  // namespace

ConnectionProbe ConnectionProbe::find(const std::string& remote_addr, int remote_port, int local_port) {
  int found = -1;
  for_each_connection([&](int fd, const std::string& host, int peer_port, int port) {
    if (host != remote_addr || peer_port != remote_port || port != local_port) return false;
    found = fd;
    return true;
  });
  return found >= 0 ? ConnectionProbe(found) : ConnectionProbe();
}

int ConnectionProbe::shutdown_all(int local_port) {
  int n = 0;
  for_each_connection([&](int fd, const std::string&, int, int port) {
    if (port == local_port && ::shutdown(fd, SHUT_RDWR) == 0) ++n;
    return false;
  });
  return n;
}

void ConnectionProbe::shut_down() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

bool ConnectionProbe::closed() const {
  if (fd_ < 0) return false;
  pollfd p{fd_, short(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) return true;
  // Readable: either bytes (a pipelined request, still connected) or end-of-file.
  char byte;
  const ssize_t n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace kvserve
