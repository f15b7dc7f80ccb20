#include "store/redis_connection.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>

#include "util/error.h"

namespace kvserve {
namespace {

timeval to_timeval(std::chrono::milliseconds ms) {
  return timeval{time_t(ms.count() / 1000), suseconds_t((ms.count() % 1000) * 1000)};
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// Writing to a server that has gone away raises SIGPIPE, which kills the
// process by default, and hiredis writes with plain write(2). Rather than
// change the process's signal disposition, this blocks SIGPIPE on the calling
// thread for the duration of a write and discards one the write raised; the
// write itself then fails with EPIPE, an ordinary error.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        (void)sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

}  // namespace

std::string RedisAddress::str() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

std::optional<RedisAddress> parse_redis_address(std::string_view text) {
  RedisAddress a;
  std::string_view port;
  if (text.starts_with('[')) {
    const size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') return std::nullopt;
    a.host = std::string(text.substr(1, close - 1));
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return std::nullopt;
    a.host = std::string(text.substr(0, colon));
    port = text.substr(colon + 1);
    if (a.host.find(':') != std::string::npos) return std::nullopt;  // a bare IPv6 address needs brackets
  }
  if (a.host.empty() || port.empty()) return std::nullopt;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), a.port);
  if (ec != std::errc() || end != port.data() + port.size() || a.port <= 0 || a.port > 65535) return std::nullopt;
  return a;
}

RedisCredentials load_redis_credentials(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) fail("cannot read the Redis auth file {}: {}", path, std::strerror(errno));
  if (st.st_mode & (S_IRGRP | S_IROTH))
    fail("the Redis auth file {} is readable by other users; restrict it with chmod 600", path);
  std::ifstream in(path);
  if (!in) fail("cannot read the Redis auth file {}", path);
  RedisCredentials c;
  bool have_password = false;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    std::string_view l = line;
    if (const size_t hash = l.find('#'); hash != std::string_view::npos) l = l.substr(0, hash);
    l = trim(l);
    if (l.empty()) continue;
    const size_t eq = l.find('=');
    if (eq == std::string_view::npos) fail("{}:{}: expected 'key = value'", path, n);
    const std::string_view key = trim(l.substr(0, eq)), value = trim(l.substr(eq + 1));
    if (key == "user") c.user = std::string(value);
    else if (key == "password") {
      c.password = std::string(value);
      have_password = true;
    } else fail("{}:{}: unknown key '{}' (expected user or password)", path, n, key);
  }
  if (!have_password || c.password.empty()) fail("the Redis auth file {} has no password", path);
  return c;
}

void RedisReplyDeleter::operator()(redisReply* reply) const { freeReplyObject(reply); }

RedisCommand& RedisCommand::arg(std::string_view text) {
  argv_.push_back(text.data());
  lengths_.push_back(text.size());
  return *this;
}

RedisCommand& RedisCommand::arg(ByteView bytes) {
  argv_.push_back(reinterpret_cast<const char*>(bytes.data()));
  lengths_.push_back(bytes.size());
  return *this;
}

RedisConnection::RedisConnection(redisContext* context, RedisAddress address, std::chrono::milliseconds timeout)
    : context_(context), address_(std::move(address)), command_timeout_(timeout) {}

RedisConnection::~RedisConnection() { redisFree(context_); }

std::unique_ptr<RedisConnection> RedisConnection::open(const RedisAddress& address,
                                                       const RedisConnectionOptions& options, std::string& error) {
  redisContext* c = redisConnectWithTimeout(address.host.c_str(), address.port, to_timeval(options.connect_timeout));
  if (c == nullptr) {
    error = fmt::format("cannot connect to Redis at {}: out of memory", address.str());
    return nullptr;
  }
  std::unique_ptr<RedisConnection> conn(new RedisConnection(c, address, options.command_timeout));
  if (c->err) {
    error = fmt::format("cannot connect to Redis at {}: {}", address.str(), c->errstr);
    return nullptr;
  }
  if (redisSetTimeout(c, to_timeval(options.command_timeout)) != REDIS_OK) {
    error = fmt::format("cannot set the Redis command timeout: {}", c->errstr);
    return nullptr;
  }
  if (!options.credentials.password.empty()) {
    RedisCommand auth;
    auth.arg("AUTH");
    if (!options.credentials.user.empty()) auth.arg(options.credentials.user);
    auth.arg(options.credentials.password);
    RedisReplyPtr reply = conn->command(auth);
    if (!reply) {
      error = conn->error();
      return nullptr;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
      error = fmt::format("Redis at {} refused AUTH{}: {}", address.str(),
                          options.credentials.user.empty() ? "" : " for user " + options.credentials.user,
                          std::string_view(reply->str, reply->len));
      return nullptr;
    }
  }
  return conn;
}

void RedisConnection::set_error_from_context() {
  // hiredis reports a socket timeout as the text of EAGAIN; say what it means.
  if (context_->err == REDIS_ERR_IO && std::string_view(context_->errstr) == std::strerror(EAGAIN))
    error_ = fmt::format("Redis at {} did not answer within {} ms", address_.str(), command_timeout_.count());
  else
    error_ = fmt::format("Redis at {}: {}", address_.str(), context_->errstr[0] ? context_->errstr : "connection lost");
}

bool RedisConnection::send(std::span<const RedisCommand> commands) {
  if (broken()) return false;
  for (const RedisCommand& c : commands) {
    if (redisAppendCommandArgv(context_, c.argc(), c.argv(), c.lengths()) != REDIS_OK) {
      set_error_from_context();
      return false;
    }
  }
  const SigpipeGuard guard;
  int done = 0;
  do {
    if (redisBufferWrite(context_, &done) != REDIS_OK) {
      set_error_from_context();
      return false;
    }
  } while (!done);
  return true;
}

bool RedisConnection::receive(size_t n, std::vector<RedisReplyPtr>& replies) {
  if (broken()) return false;
  for (size_t i = 0; i < n; ++i) {
    void* reply = nullptr;
    if (redisGetReply(context_, &reply) != REDIS_OK || reply == nullptr) {
      set_error_from_context();
      return false;
    }
    replies.emplace_back(static_cast<redisReply*>(reply));
  }
  return true;
}

RedisReplyPtr RedisConnection::command(const RedisCommand& command) {
  std::vector<RedisReplyPtr> replies;
  if (!send(std::span(&command, 1)) || !receive(1, replies)) return nullptr;
  return std::move(replies.front());
}

}  // namespace kvserve
