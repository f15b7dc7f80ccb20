// One blocking hiredis connection to one Redis server, with the connect and
// command timeouts, authentication and pipelining the Redis tier needs, and
// the credentials file it authenticates with.
//
// Pipelining: send() queues any number of commands and writes them out in one
// go; receive() then reads their replies in order. A caller talking to several
// cluster nodes sends to all of them before receiving from any, so one batch
// costs about one round trip however many nodes it touches.
//
// Errors are values: a failed call returns false/nullptr and the connection is
// broken() from then on (hiredis cannot resynchronise a stream after an I/O
// error or a timeout); its pool discards it.
//
// Thread safety: none; a pool lends a connection to one thread at a time.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "store/block_key.h"

struct redisContext;
struct redisReply;

namespace kvserve {

struct RedisAddress {
  std::string host;
  int port = 6379;

  std::string str() const;  // "host:port", "[v6addr]:port"
  friend bool operator==(const RedisAddress&, const RedisAddress&) = default;
};

// Parses "host:port" or "[ipv6]:port"; nullopt when malformed.
std::optional<RedisAddress> parse_redis_address(std::string_view text);

struct RedisCredentials {
  std::string user;      // ACL user; empty = the default user
  std::string password;  // empty = no AUTH
};

// Reads credentials from a file of `key = value` lines: `password` (required)
// and `user` (optional); '#' starts a comment. Passwords live in a file, never
// on a command line (visible in ps and shell history). Throws kvserve::Error
// when the file cannot be read, is readable by other users (chmod 600 it),
// has an unknown key or lacks the password.
RedisCredentials load_redis_credentials(const std::string& path);

struct RedisConnectionOptions {
  std::chrono::milliseconds connect_timeout{200};  // TCP connect
  std::chrono::milliseconds command_timeout{500};  // each socket read or write; a slow server costs at most this
  RedisCredentials credentials;
};

struct RedisReplyDeleter {
  void operator()(redisReply* reply) const;
};
using RedisReplyPtr = std::unique_ptr<redisReply, RedisReplyDeleter>;

// One command's arguments, pointing into memory the caller keeps alive until
// send() returns (values are not copied until hiredis formats them).
class RedisCommand {
 public:
  RedisCommand& arg(std::string_view text);
  RedisCommand& arg(ByteView bytes);

  int argc() const { return int(argv_.size()); }
  const char** argv() const { return const_cast<const char**>(argv_.data()); }
  const size_t* lengths() const { return lengths_.data(); }

 private:
  std::vector<const char*> argv_;
  std::vector<size_t> lengths_;
};

class RedisConnection {
 public:
  // Connects, authenticates (AUTH [user] password) and sets the command
  // timeout. nullptr with `error` set when any step fails.
  static std::unique_ptr<RedisConnection> open(const RedisAddress& address, const RedisConnectionOptions& options,
                                               std::string& error);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Queues the commands and writes them all to the socket.
  [[nodiscard]] bool send(std::span<const RedisCommand> commands);
  // Appends the next n replies, in command order, to `replies`. A Redis error
  // reply (-ERR, -MOVED...) is a reply, not a failure.
  [[nodiscard]] bool receive(size_t n, std::vector<RedisReplyPtr>& replies);
  // One command, one reply; nullptr on failure.
  RedisReplyPtr command(const RedisCommand& command);

  bool broken() const { return !error_.empty(); }
  const std::string& error() const { return error_; }  // why it broke; empty while healthy
  const RedisAddress& address() const { return address_; }

 private:
  RedisConnection(redisContext* context, RedisAddress address, std::chrono::milliseconds timeout);
  void set_error_from_context();

  redisContext* context_;
  RedisAddress address_;
  std::chrono::milliseconds command_timeout_;
  std::string error_;
};

}  // namespace kvserve
