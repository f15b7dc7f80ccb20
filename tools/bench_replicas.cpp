#include "tools/bench_replicas.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tools/cli_common.h"
#include "util/error.h"

extern char** environ;

namespace kvserve::cli {
namespace {

namespace fs = std::filesystem;
using std::chrono::steady_clock;

// A child process whose stdout and stderr go to a log file; stopped (SIGTERM,
// then SIGKILL after 10 s) when it goes out of scope.
class ChildProcess {
 public:
  ChildProcess(const std::vector<std::string>& argv, const fs::path& log) : log_(log) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const int rc = posix_spawnp(&pid_, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) fail("cannot start '{}': {}", argv[0], std::strerror(rc));
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() {
    if (exited()) return;
    kill(pid_, SIGTERM);
    const auto deadline = steady_clock::now() + std::chrono::seconds(10);
    while (!exited() && steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!exited()) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool exited() {
    if (done_) return true;
    done_ = waitpid(pid_, nullptr, WNOHANG) == pid_;
    return done_;
  }
  std::string log() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  pid_t pid_ = 0;
  bool done_ = false;
  fs::path log_;
};

int free_loopback_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    fail("cannot find a free loopback port: {}", std::strerror(errno));
  close(fd);
  return ntohs(addr.sin_port);
}

bool accepts_connections(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  if (fd >= 0) close(fd);
  return ok;
}

// The options of `bench` that `serve` takes too, as arguments for serve: the
// replicas run with the KV layout, engine and thread flags the bench was given.
std::vector<std::string> serve_arguments(const CLI::App& bench) {
  CLI::App probe;
  register_serve(probe);
  const CLI::App* serve = probe.get_subcommand("serve");
  static const char* const kOwn[] = {"port", "host", "kv-tiers", "tenant-secret-file", "json", "help"};
  std::vector<std::string> out;
  for (const CLI::Option* opt : bench.get_options()) {
    if (opt->count() == 0 || opt->get_lnames().empty()) continue;
    const std::string& name = opt->get_lnames().front();
    if (std::find(std::begin(kOwn), std::end(kOwn), name) != std::end(kOwn)) continue;
    if (serve->get_option_no_throw("--" + name) == nullptr) continue;
    if (opt->get_type_size_min() == 0) {
      out.push_back("--" + name);
      continue;
    }
    for (const std::string& v : opt->results()) out.push_back("--" + name + "=" + v);
  }
  return out;
}

// Sum of a Prometheus counter over its label sets, from GET /metrics.
double metric_total(const std::string& url, const std::string& name) {
  httplib::Client client(url);
  client.set_read_timeout(10, 0);
  const auto res = client.Get("/metrics");
  if (!res || res->status != 200) fail("GET {}/metrics failed", url);
  std::istringstream lines(res->body);
  double total = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : '\0';
    if (next != ' ' && next != '{') continue;
    total += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return total;
}

struct Replica {
  std::unique_ptr<ChildProcess> process;
  std::string url;
};

}  // namespace

void run_replica_bench(const ReplicaBenchOptions& o, const CLI::App& bench) {
  const WorkloadOptions& w = o.workload;
  if (o.replicas < 2) fail("--replicas must be at least 2 (got {})", o.replicas);
  if (w.name != "shared-prefix") fail("--replicas runs the shared-prefix workload (got --workload {})", w.name);
  if (w.tenants != 1) fail("--replicas runs one tenant (got --tenants {})", w.tenants);
  if (w.requests < o.replicas) fail("--requests must be at least --replicas ({})", o.replicas);
  if (!o.kv_tiers.empty() && o.kv_tiers.find("redis://") == std::string::npos)
    fail("--replicas shares blocks through Redis: --kv-tiers must name a redis:// tier (got '{}')", o.kv_tiers);

  const fs::path work = fs::temp_directory_path() / ("kvserve-replicas-" + std::to_string(getpid()));
  fs::create_directories(work);
  struct RemoveDir {
    fs::path p;
    ~RemoveDir() { std::error_code ec; fs::remove_all(p, ec); }
  } remove_work{work};

  // Redis: the given tier, else one of our own for the run.
  std::unique_ptr<ChildProcess> redis;
  std::string tiers = o.kv_tiers;
  if (tiers.empty()) {
    const int port = free_loopback_port();
    redis = std::make_unique<ChildProcess>(
        std::vector<std::string>{"redis-server", "--port", std::to_string(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", work.string()},
        work / "redis.log");
    const auto deadline = steady_clock::now() + std::chrono::seconds(10);
    while (!accepts_connections(port)) {
      if (redis->exited() || steady_clock::now() > deadline)
        fail("redis-server did not start (is it installed?): {}", redis->log());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    tiers = "redis://127.0.0.1:" + std::to_string(port);
  }
  // One tenant secret for all replicas: the same tenant's blocks get the same keys.
  {
    std::random_device rd;
    std::ofstream secret(work / "secret", std::ios::binary);
    for (int i = 0; i < 32; ++i) secret.put(char(rd()));
  }

  const std::vector<std::string> forwarded = serve_arguments(bench);
  std::vector<Replica> replicas(size_t(o.replicas));
  for (int r = 0; r < o.replicas; ++r) {
    std::vector<std::string> argv = {fs::read_symlink("/proc/self/exe").string(), "serve", "--host", "127.0.0.1",
                                     "--port", "0", "--kv-tiers", tiers, "--tenant-secret-file",
                                     (work / "secret").string()};
    argv.insert(argv.end(), forwarded.begin(), forwarded.end());
    Replica& rep = replicas[size_t(r)];
    rep.process = std::make_unique<ChildProcess>(argv, work / ("serve" + std::to_string(r) + ".log"));
    const auto deadline = steady_clock::now() + std::chrono::seconds(300);
    for (;;) {
      const std::string log = rep.process->log();
      const size_t at = log.find("listening on http://");
      if (at != std::string::npos) {
        const size_t start = at + std::string("listening on ").size();
        rep.url = log.substr(start, log.find('\n', start) - start);
        break;
      }
      if (rep.process->exited() || steady_clock::now() > deadline)
        fail("replica {} did not start: {}", r, log);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  LoadOptions load;
  load.shared_prefix = w.prefix_tokens;
  load.prompt_tokens = w.prefix_tokens + w.suffix_tokens;
  load.max_tokens = w.max_tokens;
  load.seed = w.seed;
  // Replica 0 computes the prefix.
  load.server = replicas[0].url;
  load.requests = 1;
  load.concurrency = 1;
  const LoadReport first = run_load(load);
  // Its blocks reach Redis off its engine thread: wait until the writer has
  // offered every block it accepted to the tier (or 30 s).
  const auto deadline = steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    const std::string& url = replicas[0].url;
    const double enqueued = metric_total(url, "kvserve_kv_store_enqueued_total");
    const double written = metric_total(url, "kvserve_kv_store_written_total");
    if ((enqueued > 0 && written >= enqueued) || steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  // The other replicas serve the rest, each its own share of suffixes: first
  // one request alone (it finds the prefix only in Redis: the TTFT of
  // loading it), then the others of its share (the prefix in memory now).
  nlohmann::json per_replica = nlohmann::json::array();
  std::vector<double> ttfts, load_ttfts;
  int64_t cached = 0, prompt = 0;
  int32_t failed = first.options.requests - first.completed, next_request = 1;
  double loaded = 0;
  const int32_t others = o.replicas - 1;
  for (int r = 1; r <= others; ++r) {
    load.server = replicas[size_t(r)].url;
    const int32_t share = (w.requests - 1) / others + (r <= (w.requests - 1) % others ? 1 : 0);
    nlohmann::json rj = {{"url", load.server}, {"requests", share}};
    int64_t rep_cached = 0;
    for (const int32_t n : {1, share - 1}) {
      if (n == 0) continue;
      load.first_request = next_request;
      load.requests = n;
      load.concurrency = std::min(w.concurrency, n);
      next_request += n;
      const LoadReport rep = run_load(load);
      for (const RequestSample& s : rep.samples)
        if (s.outcome == RequestSample::Outcome::Complete) ttfts.push_back(s.ttft);
      if (n == 1 && rep.completed == 1) {
        load_ttfts.push_back(rep.samples[0].ttft);
        rj["load_ttft_ms"] = rep.samples[0].ttft * 1e3;
        rj["load_cached_tokens"] = rep.samples[0].cached_tokens;
      }
      rep_cached += rep.cached_tokens;
      cached += rep.cached_tokens;
      prompt += rep.prompt_tokens;
      failed += rep.options.requests - rep.completed;
    }
    const double blocks = metric_total(load.server, "kvserve_tier_blocks_loaded_total");
    loaded += blocks;
    rj["cached_tokens"] = rep_cached;
    rj["tier_blocks_loaded"] = blocks;
    per_replica.push_back(rj);
  }
  const double load_ms = percentiles(load_ttfts).p50 * 1e3;
  const Percentiles t = percentiles(ttfts);
  const double compute_ms = first.ttft.p50 * 1e3;
  nlohmann::json j = {{"workload", "shared-prefix"},
                      {"replicas", o.replicas},
                      {"kv_tiers", o.kv_tiers.empty() ? std::string("redis (started for the run)") : o.kv_tiers},
                      {"prefix_tokens", w.prefix_tokens},
                      {"prompt_tokens_per_request", w.prefix_tokens + w.suffix_tokens},
                      {"requests", w.requests},
                      {"compute_ttft_ms", compute_ms},
                      {"load_ttft_ms", load_ms},
                      {"replica_ttft_p50_ms", t.p50 * 1e3},
                      {"replica_ttft_p99_ms", t.p99 * 1e3},
                      {"ttft_speedup", load_ms > 0 ? compute_ms / load_ms : 0.0},
                      {"replica_prompt_tokens", prompt},
                      {"replica_cached_tokens", cached},
                      {"replica_hit_rate", prompt ? double(cached) / double(prompt) : 0.0},
                      {"tier_blocks_written", metric_total(replicas[0].url, "kvserve_tier_blocks_written_total")},
                      {"tier_blocks_loaded", loaded},
                      {"failed", failed},
                      {"per_replica", per_replica}};
  if (o.json) {
    print_json(j);
    return;
  }
  std::printf("replicas: %d serve processes sharing %s | replica 0 computed the %d-token prefix: TTFT %.1f ms | "
              "replicas 1-%d loaded it: TTFT %.1f ms (%.1fx lower) | all their requests: TTFT p50 %.1f ms p99 %.1f "
              "ms, %lld of %lld prompt tokens cached, %.0f blocks loaded | %d failed\n",
              o.replicas, tiers.c_str(), w.prefix_tokens, compute_ms, others, load_ms,
              j["ttft_speedup"].get<double>(), t.p50 * 1e3, t.p99 * 1e3, (long long)cached, (long long)prompt, loaded,
              failed);
}

}  // namespace kvserve::cli
