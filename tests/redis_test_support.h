// Real Redis servers for tests: a redis-server child process on a loopback
// port (killed at teardown), a 3-node Redis Cluster, and one-off commands.
// Tests skip (GTEST_SKIP) only when redis-server is not installed.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "store/redis_connection.h"

namespace kvserve::testing_redis {

inline bool on_path(const char* program) {
  return std::system(fmt::format("command -v {} > /dev/null 2>&1", program).c_str()) == 0;
}

inline bool redis_installed() { return on_path("redis-server") && on_path("redis-cli"); }

inline bool port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A port in [20000, 30000) that is free, and whose cluster bus port (+10000) is too.
inline int free_port() {
  static std::mt19937 rng(uint32_t(::getpid()) * 7919u + uint32_t(std::chrono::steady_clock::now().time_since_epoch().count()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = 20000 + int(rng() % 10000);
    if (port_free(port) && port_free(port + 10000)) return port;
  }
  ADD_FAILURE() << "no free loopback port";
  return 0;
}

inline std::string make_temp_dir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("kvserve-" + tag + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
  return tmpl;
}

// One command on a fresh connection; nullptr when the server is unreachable.
inline RedisReplyPtr redis_command(int port, const std::vector<std::string>& args,
                                   const RedisCredentials& credentials = {}) {
  RedisConnectionOptions o;
  o.connect_timeout = std::chrono::milliseconds(500);
  o.command_timeout = std::chrono::milliseconds(5000);
  o.credentials = credentials;
  std::string error;
  auto conn = RedisConnection::open(RedisAddress{"127.0.0.1", port}, o, error);
  if (!conn) return nullptr;
  RedisCommand c;
  for (const std::string& a : args) c.arg(a);
  return conn->command(c);
}

inline std::string reply_string(const RedisReplyPtr& r) {
  if (!r) return "<no reply>";
  if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
  if (r->str) return std::string(r->str, r->len);
  return "";
}

// redis-server on 127.0.0.1:port as a child process.
class RedisServer {
 public:
  RedisServer(int port, std::vector<std::string> extra, std::string dir)
      : port_(port), extra_(std::move(extra)), dir_(std::move(dir)) {
    start();
  }
  ~RedisServer() { kill(); }

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  RedisAddress address() const { return RedisAddress{"127.0.0.1", port_}; }

  // Starts the server and waits until it answers (any reply, NOAUTH included).
  void start() {
    std::vector<std::string> args = {"redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", dir_,
                                     "--logfile", dir_ + "/redis-" + std::to_string(port_) + ".log"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      const int null = ::open("/dev/null", O_RDWR);
      ::dup2(null, 1);
      ::dup2(null, 2);
      ::execvp("redis-server", argv.data());
      ::_exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      if (redis_command(port_, {"PING"})) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ADD_FAILURE() << "redis-server on port " << port_ << " did not start";
  }
  // SIGKILL: the server dies at once, as in a crash.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  void pause() { ::kill(pid_, SIGSTOP); }   // a hung server: accepts nothing, answers nothing
  void resume() { ::kill(pid_, SIGCONT); }

 private:
  int port_;
  std::vector<std::string> extra_;
  std::string dir_;
  pid_t pid_ = -1;
};

// Three masters, no replicas, on loopback; full coverage not required so
// the surviving nodes keep serving when one is killed.
class RedisCluster {
 public:
  RedisCluster() : dir_(make_temp_dir("cluster")) {
    for (int i = 0; i < 3; ++i) {
      const int port = free_port();
      nodes_.push_back(std::make_unique<RedisServer>(
          port,
          std::vector<std::string>{"--cluster-enabled", "yes", "--cluster-config-file",
                                   "nodes-" + std::to_string(port) + ".conf", "--cluster-node-timeout", "2000",
                                   "--cluster-require-full-coverage", "no"},
          dir_));
    }
    std::string cmd = "redis-cli --cluster create";
    for (auto& n : nodes_) cmd += " 127.0.0.1:" + std::to_string(n->port());
    cmd += " --cluster-replicas 0 --cluster-yes > " + dir_ + "/create.log 2>&1";
    if (std::system(cmd.c_str()) != 0) ADD_FAILURE() << "redis-cli --cluster create failed; see " << dir_;
    wait_ok();
  }
  ~RedisCluster() {
    nodes_.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  RedisServer& node(size_t i) { return *nodes_[i]; }
  size_t size() const { return nodes_.size(); }

  // Waits until every running node reports cluster_state:ok.
  void wait_ok() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (std::chrono::steady_clock::now() < deadline) {
      bool ok = true;
      for (auto& n : nodes_) {
        if (n->pid() <= 0) continue;
        if (reply_string(redis_command(n->port(), {"CLUSTER", "INFO"})).find("cluster_state:ok") == std::string::npos)
          ok = false;
      }
      if (ok) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "the Redis cluster did not reach cluster_state:ok";
  }

  std::string node_id(size_t i) { return reply_string(redis_command(nodes_[i]->port(), {"CLUSTER", "MYID"})); }
  // The node index serving `slot`.
  size_t owner_of(int slot) {
    const RedisReplyPtr slots = redis_command(nodes_[0]->port(), {"CLUSTER", "SLOTS"});
    for (size_t e = 0; slots && e < slots->elements; ++e) {
      const redisReply* r = slots->element[e];
      if (slot >= r->element[0]->integer && slot <= r->element[1]->integer) {
        const long long port = r->element[2]->element[1]->integer;
        for (size_t i = 0; i < nodes_.size(); ++i)
          if (nodes_[i]->port() == port) return i;
      }
    }
    ADD_FAILURE() << "no node serves slot " << slot;
    return 0;
  }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<RedisServer>> nodes_;
};

// Polls `condition` every 10 ms for up to `seconds`.
template <class F>
bool eventually(F&& condition, double seconds = 10.0) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return condition();
}

}  // namespace kvserve::testing_redis
