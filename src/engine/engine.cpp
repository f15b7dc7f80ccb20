#include "engine/engine.h"

#include <algorithm>
#include <cassert>

#include <openssl/sha.h>

#include <random>

#include <xxhash.h>

#include "store/tier_spec.h"
#include "util/error.h"
#include "util/timer.h"

namespace kvserve {

std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::None: return "none";
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
  }
  return "none";
}

Engine::Engine(const Model& model, const EngineOptions& options)
    : model_(model),
      options_(options),
      pool_(options.threads == 0 ? default_thread_count() : options.threads),
      cache_(model.config(), options.kv),
      transformer_(model, pool_),
      prefix_([&]() -> std::unique_ptr<PrefixCache> {
        if (!options.prefix_caching) return nullptr;
        PrefixCacheOptions p = options.prefix;
        if (p.model_id.empty()) p.model_id = model.fingerprint();
        return std::make_unique<PrefixCache>(cache_, p, clock_);
      }()),
      scheduler_(options.scheduler, cache_, prefix_hooks()),
      epoch_(std::chrono::steady_clock::now()) {
  if (options.threads < 0) fail("threads must be >= 0 (got {})", options.threads);
  if (options.max_waiting <= 0) fail("the waiting queue must hold at least one request (got {})", options.max_waiting);
  // The default policy of requests that name none: refused here, not at every request.
  (void)resolve_sparsity_options(options.sparsity, cache_);
  tokenizer_ = model.tokenizer();
  if (tokenizer_) {
    end_ids_ = tokenizer_->end_of_generation_ids();
    end_ids_.push_back(tokenizer_->bos_id());
  }
  if (!options.kv_tiers.empty()) {
    if (!prefix_) fail("--kv-tiers needs prefix caching (blocks are stored under their prefix-cache keys)");
    // A block read back from a tier comes without the FP16 form queries near
    // it would read from a residual window longer than one block.
    if (cache_.residual() > cache_.block_size())
      fail("--kv-tiers needs a residual window of at most one block (got {} tokens; pass --kv-residual {})",
           cache_.residual(), cache_.block_size());
    TieredKvStoreOptions t;
    const std::string& id = model.fingerprint();
    t.identity = {XXH3_64bits(id.data(), id.size()), cache_.block_codec_hash()};
    t.payload_bytes = cache_.block_record_bytes();
    store_ = open_tiered_kv_store(options.kv_tiers, t);
  }
  if (options.cache_event_log < 0) fail("the cache event log must hold >= 0 events (got {})", options.cache_event_log);
  if (options.cache_event_log > 0 && !prefix_) fail("cache events need prefix caching");
  if (store_ || options.cache_event_log > 0)
    prefix_->set_event_listener([this](const CacheEvent& e) { on_cache_event(e); });
  tenant_secret_ = options.tenant_secret;
  // Without one given, a disk tier's kept secret: its blocks stay findable
  // after a restart (a fresh random one made them all unreachable).
  if (tenant_secret_.empty() && store_) tenant_secret_ = store_->kept_secret().value_or("");
  if (tenant_secret_.empty()) {
    std::random_device rd;
    for (int i = 0; i < 32; ++i) tenant_secret_.push_back(char(rd() & 0xff));
  }
  local_.kv = cache_.stats();
  local_.prefix_caching = prefix_ != nullptr;
  local_.tiers = store_ != nullptr;
  stats_ = local_;
}

PrefixHooks Engine::prefix_hooks() {
  if (!prefix_) return {};
  PrefixHooks h;
  // Sequences share only the tokens whose KV anyone would compute alike
  // (Sequence::shareable_tokens); evicting ones share nothing.
  auto shareable = [](const Sequence& seq) { return std::span(seq.tokens()).first(size_t(seq.shareable_tokens())); };
  // topk and ann rebuild a hit's summaries or index from the keys read back
  // from the cache: the ones they would build themselves only when keys are
  // stored exactly (FP32, rotated at most by their position). On a lossy
  // cache such a sequence computes its prompt instead of taking a hit.
  bool exact_keys = true;
  for (int l = 0; l < cache_.n_layers(); ++l)
    exact_keys = exact_keys && cache_.k_codec(l).config().dtype == KvDType::F32 && cache_.k_rope_span(l) == 1;
  auto takes_hits = [exact_keys](const Sequence& seq) {
    if (seq.evicting() || seq.request().prompt_logprobs) return false;  // the latter needs every position's logits
    return exact_keys || !seq.policy || !seq.policy->selects_reads();
  };
  h.cached_tokens = [this, shareable, takes_hits](Sequence& seq, int32_t* idle_blocks) {
    if (idle_blocks) *idle_blocks = 0;
    if (!takes_hits(seq)) return 0;
    prefix_->block_keys(seq.scope, shareable(seq), seq.keys);
    return prefix_->cached_tokens(seq.scope, seq.keys, seq.shareable_tokens(), idle_blocks);
  };
  h.inflight_tokens = [this, shareable, takes_hits](Sequence& seq) {
    if (!takes_hits(seq)) return 0;
    prefix_->block_keys(seq.scope, shareable(seq), seq.keys);
    // Leading blocks seq shares with a running sequence that will have computed
    // them when its prefill ends (its keys cover its whole prompt by then).
    size_t best = 0;
    for (const Sequence* r : scheduler_.running()) {
      if (r->decoding()) continue;
      size_t n = 0;
      while (n < seq.keys.size() && n < r->keys.size() && seq.keys[n] == r->keys[n]) ++n;
      best = std::max(best, n);
    }
    return int32_t(best) * cache_.block_size();
  };
  h.match = [this, shareable, takes_hits](Sequence& seq) {
    if (!takes_hits(seq)) return 0;
    prefix_->block_keys(seq.scope, shareable(seq), seq.keys);
    const PrefixMatch m = prefix_->match(seq.scope, seq.keys, seq.shareable_tokens(), seq.table);
    seq.checkpoint = m.checkpoint_tokens;
    return m.cached_tokens + (store_ ? load_from_tiers(seq) * cache_.block_size() : 0);
  };
  h.make_room = [this] { return prefix_->unpin_all() + prefix_->release_idle_sidecars(); };
  h.release = [this, shareable](Sequence& seq) {
    if (seq.evicting()) return cache_.release(seq.table);
    prefix_->block_keys(seq.scope, shareable(seq).first(size_t(std::min(seq.table.num_tokens, seq.shareable_tokens()))),
                        seq.keys);
    prefix_->release(seq.scope, seq.table, seq.keys);
    write_published(seq);
  };
  return h;
}

CacheScope Engine::scope_for(const Request& r) {
  CacheScope scope;
  if (!prefix_) return scope;
  if (options_.prefix_scope == CacheScopeKind::Global && r.session.empty()) return scope;
  if (!r.tenant.empty() && options_.prefix_scope != CacheScopeKind::Global) {
    auto [it, fresh] = tenants_.try_emplace(r.tenant, kGlobalTenant);
    if (fresh) {
      // The salt: SHA-256 of the secret and the name, never anything a client sends.
      std::string material = tenant_secret_ + '\0' + r.tenant;
      unsigned char digest[SHA256_DIGEST_LENGTH];
      SHA256(reinterpret_cast<const unsigned char*>(material.data()), material.size(), digest);
      TenantOptions t;
      t.name = r.tenant;
      t.salt.assign(reinterpret_cast<const char*>(digest), sizeof digest);
      t.quota_blocks = options_.tenant_quota_blocks;
      it->second = prefix_->add_tenant(t);
      std::lock_guard<std::mutex> lock(events_mutex_);
      tenant_names_[it->second] = r.tenant;
    }
    scope.kind = CacheScopeKind::Tenant;
    scope.tenant = it->second;
  }
  if (!r.session.empty()) {
    scope.kind = CacheScopeKind::Session;
    scope.session = r.session;
  }
  return scope;
}

void Engine::publish_prefix(Sequence& seq) {
  if (!prefix_ || seq.evicting()) return;
  prefix_->block_keys(seq.scope, std::span(seq.tokens()).first(size_t(std::min(seq.num_computed, seq.shareable_tokens()))),
                      seq.keys);
  prefix_->publish(seq.scope, seq.table, seq.keys);
  write_published(seq);
  if (seq.request().pin_prefix && !seq.pinned && seq.num_computed >= seq.num_prompt()) {
    const size_t blocks = std::min(seq.keys.size(), size_t(seq.num_prompt() / cache_.block_size()));
    (void)prefix_->pin(seq.scope, std::span(seq.keys).first(blocks));
    seq.pinned = true;
  }
}

void Engine::on_cache_event(const CacheEvent& e) {
  if (store_ && e.kind == CacheEventKind::Stored) stored_.push_back(e);
  if (options_.cache_event_log <= 0) return;
  std::lock_guard<std::mutex> lock(events_mutex_);
  const auto name = tenant_names_.find(e.tenant);
  event_log_.push_back({next_event_seq_++, e, name == tenant_names_.end() ? std::string() : name->second});
  if (event_log_.size() > size_t(options_.cache_event_log)) event_log_.pop_front();
}

CacheEventPage Engine::cache_events(const CacheEventQuery& q) const {
  CacheEventPage page;
  std::lock_guard<std::mutex> lock(events_mutex_);
  page.first_kept = event_log_.empty() ? next_event_seq_ : event_log_.front().seq;
  page.next = std::max(q.after, page.first_kept - 1);
  // The log's numbers are consecutive: the first event after `next` is found by its number.
  const size_t begin = size_t(std::min<uint64_t>(page.next - (page.first_kept - 1), event_log_.size()));
  const size_t end = begin + std::min(q.max_scanned, event_log_.size() - begin);
  for (size_t i = begin; i < end && page.events.size() < q.max; ++i) {
    const CacheEventRecord& r = event_log_[i];
    if (!q.tenant || r.tenant.empty() || r.tenant == *q.tenant) page.events.push_back(r);
    page.next = r.seq;
  }
  return page;
}

void Engine::write_published(const Sequence& seq) {
  if (!store_ || stored_.empty()) return;
  // A chain's blocks share one tag (its first key): the Redis tier keeps them
  // in one cluster slot, so a later lookup of the chain is one round trip.
  const ChainTag chain = seq.keys.empty() ? ChainTag() : ChainTag(seq.keys[0]);
  for (const CacheEvent& e : stored_) {
    cache_.export_block(e.block, block_bytes_);
    if (store_->put(e.key, block_bytes_, chain)) ++local_.tier_blocks_queued;
  }
  stored_.clear();
}

int32_t Engine::load_from_tiers(Sequence& seq) {
  const int32_t bs = cache_.block_size();
  const int32_t have = seq.table.num_tokens / bs;
  // As match(): the last shareable token is always computed.
  const int32_t eligible = std::min<int32_t>(int32_t(seq.keys.size()), (seq.shareable_tokens() - 1) / bs);
  if (have >= eligible) return 0;
  // Load when that measured cheaper than computing (medians of recent
  // samples: one descheduled lookup does not decide); probe now and then so a
  // tier that got faster (or a cache that got warmer) is noticed.
  if (local_.tier_load_ms_per_block > 0 && local_.recompute_ms_per_block > 0 &&
      local_.tier_load_ms_per_block > local_.recompute_ms_per_block && ++skipped_since_probe_ < 16) {
    ++local_.tier_lookups_skipped;
    return 0;
  }
  // Fetch only when memory can hold the whole prompt now. Otherwise the
  // admission fails after the fetch, the loaded blocks go idle, other
  // sequences reclaim them and the next try fetches them again (a helper saw
  // 3,215 blocks read from Redis for 437 used).
  const int32_t prompt_blocks = cache_.blocks_for(int64_t(seq.tokens().size())) - int32_t(seq.table.blocks.size());
  if (cache_.pool().num_available() < prompt_blocks) return 0;
  skipped_since_probe_ = 0;
  ++local_.tier_lookups;
  Timer timer;
  const std::vector<LoadedBlock> found =
      store_->lookup(std::span(seq.keys).subspan(size_t(have), size_t(eligible - have)), ChainTag(seq.keys[0]));
  int32_t loaded = int32_t(found.size());
  // Imported blocks arrive sealed: no staging slots. No room: compute them later, or wait.
  if (loaded > 0 && !cache_.reserve(seq.table, loaded * bs, 0)) loaded = 0;
  for (int32_t j = 0; j < loaded; ++j)
    cache_.import_block(seq.table.blocks[size_t(have + j)], found[size_t(j)].payload());
  if (loaded > 0) {
    cache_.commit(seq.table, loaded * bs);
    // Cache them in memory too; they are in the tiers already.
    prefix_->publish(seq.scope, seq.table, seq.keys);
    stored_.clear();
    // The tenant's hit counters count them as the usage's cached tokens do.
    prefix_->count_loaded_hits(seq.scope, loaded);
  }
  // Only lookups that loaded blocks say what loading a block costs: a miss
  // recorded as one block's cost made one cold miss on a slow tier turn
  // loading off (skipped 15 lookups in 16) for blocks that were there later.
  if (loaded > 0) {
    tier_load_ms_.add(timer.seconds() * 1e3 / double(loaded));
    local_.tier_load_ms_per_block = tier_load_ms_.value();
  }
  local_.tier_blocks_loaded += loaded;
  return loaded;
}

Engine::~Engine() {
  if (started_) shutdown(false);
  if (prefix_) prefix_->set_event_listener(nullptr);
}

double Engine::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_).count();
}

SequenceFootprint Engine::footprint(const SparsityOptions& sparsity, int64_t prompt, int64_t total) const {
  const SparsityOptions& s = sparsity.policy.empty() ? options_.sparsity : sparsity;
  SequenceFootprint fp{total, false};
  // Prompt chunks are the largest writes (generated tokens, replayed ones
  // included, come one a step).
  const int32_t chunk = int32_t(std::clamp<int64_t>(prompt, 1, options_.scheduler.max_batch_prefill_tokens));
  const SparsityLimits limits = sparsity_limits(s, cache_, chunk);
  if (limits.max_tokens_held >= 0) fp.held_tokens = std::min(total, limits.max_tokens_held);
  fp.unbounded_positions = limits.unbounded_positions;
  // Positions within the cache run up to the live tokens (at most the budget)
  // plus the chunk being written: past the context, the forward pass would
  // refuse mid-generation.
  const int32_t ctx = model_.config().seq_len;
  if (fp.unbounded_positions && total > ctx && int64_t(s.budget) + chunk > ctx)
    fail("with positions within the cache, a budget of {} and a prompt chunk of {} tokens reach position {}, past "
         "the context length of {}; lower the budget (or the prefill chunk)",
         s.budget, chunk, int64_t(s.budget) + chunk, ctx);
  return fp;
}

SubmitResult Engine::submit(Request request) {
  std::vector<Request> one;
  one.push_back(std::move(request));
  SubmitBatchResult b = submit_all(std::move(one));
  return {b.status, b.ids.empty() ? 0 : b.ids[0], std::move(b.error)};
}

SubmitBatchResult Engine::submit_all(std::vector<Request> requests) {
  auto invalid = [](std::string message) {
    return SubmitBatchResult{SubmitResult::Status::Invalid, {}, std::move(message)};
  };
  if (requests.empty()) return invalid("no requests");
  for (size_t i = 0; i < requests.size(); ++i)
    if (std::optional<std::string> e = check(requests[i]))
      return invalid(requests.size() > 1 ? fmt::format("request {}: {}", i, *e) : *e);
  if (int64_t(requests.size()) > options_.max_waiting)
    return invalid(fmt::format("{} sequences at once are more than the waiting queue holds ({})", requests.size(),
                               options_.max_waiting));

  std::lock_guard<std::mutex> lock(inbox_mutex_);
  if (stopping_) return SubmitBatchResult{SubmitResult::Status::QueueFull, {}, "the server is shutting down"};
  if (int64_t(inbox_.requests.size()) + waiting_.load() + int64_t(requests.size()) > options_.max_waiting) {
    std::lock_guard<std::mutex> s(stats_mutex_);
    // Sequences, as submitted and finished count them: a refused request
    // with n choices is n (finished = submitted holds against what clients sent).
    stats_.requests_rejected += int64_t(requests.size());
    return SubmitBatchResult{SubmitResult::Status::QueueFull, {}, "too many requests are waiting"};
  }
  SubmitBatchResult out;
  for (Request& r : requests) {
    const RequestId id = next_id_++;
    inbox_.requests.push_back(std::make_unique<Sequence>(id, std::move(r), next_order_++, now()));
    out.ids.push_back(id);
  }
  inbox_cv_.notify_one();
  return out;
}

std::optional<std::string> Engine::check(Request& r) const {
  const ModelConfig& c = model_.config();
  auto invalid = [](std::string message) { return std::optional<std::string>(std::move(message)); };
  if (r.prompt.empty()) return invalid("the prompt has no tokens");
  for (int32_t t : r.prompt)
    if (t < 0 || t >= c.vocab_size)
      return invalid(fmt::format("token id {} is out of range (vocabulary of {})", t, c.vocab_size));
  if (r.max_tokens < (r.prompt_logprobs ? 0 : 1))
    return invalid(fmt::format("max_tokens must be at least {} (got {})", r.prompt_logprobs ? 0 : 1, r.max_tokens));
  if (r.prompt_logprobs && r.logprobs < 0) return invalid("prompt log-probabilities need logprobs >= 0");
  const int64_t total = int64_t(r.prompt.size()) + r.max_tokens;
  if (int64_t(r.prompt.size()) > c.seq_len || (int64_t(r.prompt.size()) == c.seq_len && r.max_tokens > 0))
    return invalid(fmt::format("the prompt has {} tokens; the model's context length is {}", r.prompt.size(), c.seq_len));
  if (r.sparsity.policy.empty()) r.sparsity = options_.sparsity;
  SequenceFootprint fp;
  try {
    fp = footprint(r.sparsity, int64_t(r.prompt.size()), total);
  } catch (const Error& e) {
    return invalid(e.what());
  }
  const int64_t held = fp.held_tokens;
  if (total > c.seq_len && !fp.unbounded_positions)
    return invalid(fmt::format("prompt ({} tokens) + max_tokens ({}) = {} exceeds the context length of {}",
                               r.prompt.size(), r.max_tokens, total, c.seq_len));
  if (!cache_.fits(held, options_.scheduler.max_batch_prefill_tokens)) {
    if (cache_.staging_cost_blocks() == 0)
      return invalid(fmt::format("prompt + max_tokens = {} tokens need {} KV blocks; the cache has {}", held,
                                 cache_.blocks_for(held), cache_.pool().num_blocks()));
    return invalid(fmt::format("prompt + max_tokens = {} tokens do not fit: the KV budget holds at most {} tokens of one "
                               "sequence once the FP16 staging of its residual window and of a prefill chunk of up to "
                               "{} tokens is paid for",
                               held, max_sequence_tokens(), options_.scheduler.max_batch_prefill_tokens));
  }
  try {
    r.sampling.validate();
  } catch (const Error& e) {
    return invalid(e.what());
  }
  for (const std::string& s : r.stop)
    if (s.empty()) return invalid("stop strings must not be empty");
  if (r.tenant == "global") return invalid("the tenant name 'global' is reserved for the shared cache scope");
  for (int32_t t : r.stop_token_ids)
    if (t < 0 || t >= c.vocab_size)
      return invalid(fmt::format("stop token id {} is out of range (vocabulary of {})", t, c.vocab_size));
  for (const auto& [t, bias] : r.sampling.logit_bias)
    if (t >= c.vocab_size)
      return invalid(fmt::format("logit bias token id {} is out of range (vocabulary of {})", t, c.vocab_size));
  for (int32_t t : r.sampling.allowed_tokens)
    if (t >= c.vocab_size)
      return invalid(fmt::format("allowed token id {} is out of range (vocabulary of {})", t, c.vocab_size));
  for (const std::vector<int32_t>& word : r.sampling.bad_words)
    for (int32_t t : word)
      if (t >= c.vocab_size)
        return invalid(fmt::format("bad word token id {} is out of range (vocabulary of {})", t, c.vocab_size));
  if (!r.sampling.allowed_tokens.empty()) {
    // Some allowed token must survive the bans that hold from the first step.
    std::vector<int32_t> left = r.sampling.allowed_tokens;
    auto drop = [&left](int32_t t) { left.erase(std::remove(left.begin(), left.end(), t), left.end()); };
    for (const std::vector<int32_t>& word : r.sampling.bad_words)
      if (word.size() == 1) drop(word[0]);
    if (r.min_tokens > 0) {
      if (r.stop_at_eos) std::for_each(end_ids_.begin(), end_ids_.end(), drop);
      std::for_each(r.stop_token_ids.begin(), r.stop_token_ids.end(), drop);
    }
    if (left.empty())
      return invalid("allowed_token_ids leave no token to sample: every one is a bad word or an end token held back "
                     "by min_tokens");
  }
  if (r.logprobs < -1 || r.logprobs > kMaxTopLogprobs)
    return invalid(fmt::format("logprobs must be between 0 and {} (got {})", kMaxTopLogprobs, r.logprobs));
  if (r.min_tokens < 0 || r.min_tokens > r.max_tokens)
    return invalid(fmt::format("min_tokens ({}) must be between 0 and max_tokens ({})", r.min_tokens, r.max_tokens));
  return std::nullopt;
}

void Engine::cancel(RequestId id) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    inbox_.cancels.push_back(id);
    inbox_cv_.notify_one();
  }
  std::lock_guard<std::mutex> lock(stats_mutex_);
  ++stats_.cancels_requested;
}

void Engine::absorb_inbox() {
  Inbox in;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    std::swap(in, inbox_);
  }
  for (auto& seq : in.requests) {
    ++local_.requests_submitted;
    seq->scope = scope_for(seq->request());
    if (seq->request().sparsity.policy != "full") seq->policy = make_sparsity_policy(seq->request().sparsity, cache_);
    scheduler_.add(seq.get());
    sequences_.emplace(seq->id(), std::move(seq));
  }
  for (RequestId id : in.cancels) {
    auto it = sequences_.find(id);
    if (it != sequences_.end()) finish(it->second.get(), FinishReason::Cancelled, -1, it->second->take_held_text());
  }
}

void Engine::finish(Sequence* seq, FinishReason reason, int32_t token, std::string text, std::string error,
                    std::optional<TokenLogprobs> logprobs, bool request_error) {
  scheduler_.finish(seq);
  RequestEvent ev;
  ev.id = seq->id();
  ev.token = token;
  ev.logprobs = std::move(logprobs);
  take_prompt_logprobs(*seq, ev);
  ev.text = std::move(text);
  ev.finish = reason;
  ev.error = std::move(error);
  ev.request_error = request_error;
  ev.usage = {seq->num_prompt(), seq->num_generated(), seq->cached_tokens};
  ev.ttft_seconds = seq->first_token_seconds > 0 ? seq->first_token_seconds - seq->arrival_seconds() : 0;
  ++local_.requests_finished;
  switch (reason) {
    case FinishReason::Stop: ++local_.finished_stop; break;
    case FinishReason::Length: ++local_.finished_length; break;
    case FinishReason::Cancelled: ++local_.finished_cancelled; break;
    default: ++local_.finished_error; break;
  }
  local_.e2e.observe(now() - seq->arrival_seconds());
  if (seq->request().on_event) seq->request().on_event(ev);
  sequences_.erase(seq->id());
}

bool Engine::ends_generation(const Request& r, int32_t token) const {
  auto in = [token](const std::vector<int32_t>& ids) { return std::find(ids.begin(), ids.end(), token) != ids.end(); };
  return (r.stop_at_eos && in(end_ids_)) || in(r.stop_token_ids);
}

void Engine::on_logits(Sequence* seq, const float* logits) {
  const Request& r = seq->request();
  if (r.max_tokens == 0) {  // the prompt's log-probabilities only
    finish(seq, FinishReason::Length, -1, {});
    return;
  }
  // Before min_tokens the end tokens cannot be sampled.
  thread_local std::vector<int32_t> banned;
  banned.clear();
  if (seq->num_generated() < r.min_tokens) {
    if (r.stop_at_eos) banned = end_ids_;
    banned.insert(banned.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
  }
  const std::span<const int32_t> all(seq->tokens());
  const SamplingContext context{all.first(size_t(seq->num_prompt())), all.subspan(size_t(seq->num_prompt())), banned};
  const int32_t next = seq->sampler.sample(logits, model_.config().vocab_size, context);
  if (next < 0) {
    finish(seq, FinishReason::Error, -1, seq->take_held_text(),
           "no token may be sampled: allowed_token_ids, bad_words and the end tokens banned before min_tokens "
           "exclude every token",
           std::nullopt, /*request_error=*/true);
    return;
  }
  const double t = now();
  if (seq->first_token_seconds == 0) {
    seq->first_token_seconds = t;
    local_.ttft.observe(t - seq->arrival_seconds());
  } else {
    local_.tpot.observe(t - seq->last_token_seconds);
  }
  seq->last_token_seconds = t;
  if (ends_generation(r, next)) {
    // The end token counts as generated (OpenAI's and vLLM's usage) but
    // adds no text.
    seq->append(next, {});
    ++local_.generated_tokens;
    finish(seq, FinishReason::Stop, -1, seq->take_held_text());
    return;
  }
  // Only for tokens the client sees (an end token has none).
  std::optional<TokenLogprobs> logprobs;
  if (r.logprobs >= 0) logprobs = token_logprobs(logits, model_.config().vocab_size, next, r.logprobs);
  const int32_t prev = seq->tokens().back();
  const Sequence::Appended a = seq->append(next, tokenizer_ ? tokenizer_->decode_piece(prev, next) : std::string());
  ++local_.generated_tokens;
  if (a.stopped) {
    finish(seq, FinishReason::Stop, next, a.text, {}, std::move(logprobs));
    return;
  }
  // Submit guaranteed prompt + max_tokens <= the context length.
  if (seq->num_generated() >= seq->request().max_tokens) {
    finish(seq, FinishReason::Length, next, a.text + seq->take_held_text(), {}, std::move(logprobs));
    return;
  }
  RequestEvent ev;
  ev.id = seq->id();
  ev.token = next;
  ev.text = a.text;
  ev.logprobs = std::move(logprobs);
  ev.usage = {seq->num_prompt(), seq->num_generated(), seq->cached_tokens};
  ev.ttft_seconds = seq->first_token_seconds - seq->arrival_seconds();
  take_prompt_logprobs(*seq, ev);
  if (seq->request().on_event) seq->request().on_event(ev);
}

void Engine::take_prompt_logprobs(Sequence& seq, RequestEvent& ev) {
  if (!seq.request().prompt_logprobs || seq.prompt_logprobs_sent) return;
  ev.prompt_logprobs = std::move(seq.prompt_logprobs);
  seq.prompt_logprobs_sent = true;
}

void Engine::record_prompt_logprobs(Sequence& seq, const BatchEntry& entry, size_t e, int32_t first) {
  // Row r predicts the token after slot first + r; each prompt token once
  // (a preempted sequence computes its prompt again).
  if (seq.prompt_logprobs_sent) return;
  const int32_t vocab = model_.config().vocab_size;
  for (int32_t r = 0; r < int32_t(entry.tokens.size()); ++r) {
    const int32_t next = first + r + 1;
    if (next >= seq.num_prompt() || next != int32_t(seq.prompt_logprobs.size()) + 1) continue;
    seq.prompt_logprobs.push_back(
        token_logprobs(logits_.row(logits_.first_row[e] + r), vocab, seq.tokens()[size_t(next)], seq.request().logprobs));
  }
}

bool Engine::step() {
  assert(!started_);
  return run_step();
}

bool Engine::run_step() {
  absorb_inbox();
  SchedulePlan plan = scheduler_.schedule();
  local_.preemptions += int64_t(plan.preempted.size());
  for (Sequence* seq : plan.admitted) {
    // A preempted sequence is recomputed from scratch: so is its policy's state.
    if (seq->preemptions > 0 && seq->policy) seq->policy = make_sparsity_policy(seq->request().sparsity, cache_);
    if (seq->preemptions > 0) continue;  // counted at its first admission
    local_.prompt_tokens += seq->num_prompt();
    local_.cached_prompt_tokens += seq->cached_tokens;
  }
  if (plan.empty()) {
    publish_stats();
    // A step that only preempted (the running sequence was its own victim)
    // changed the state: the next one admits again. Reporting it idle left
    // the engine thread waiting for input that might never come.
    return !plan.preempted.empty();
  }
  Timer timer;
  std::vector<BatchEntry> batch;
  if (!forward(plan, batch)) {
    publish_stats();
    return true;
  }
  local_.prefill_tokens_computed += plan.prefill_tokens;
  if (plan.prefill_tokens > 0) {
    // Cost per token of a step that prefills (its decode tokens count as tokens too).
    int64_t tokens = 0;
    for (const ScheduledChunk& c : plan.chunks) tokens += c.n_tokens;
    const double ms = timer.seconds() * 1e3 * cache_.block_size() / double(tokens);
    recompute_ms_.add(ms);
    local_.recompute_ms_per_block = recompute_ms_.value();
  }
  ++local_.steps;
  local_.max_running = std::max(local_.max_running, int32_t(scheduler_.num_running()));
  // Snapshot the KV use before finished sequences give their blocks back.
  local_.kv_bytes_peak = std::max(local_.kv_bytes_peak, cache_.stats().bytes_used);
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    Sequence* seq = plan.chunks[i].seq;
    if (batch[i].all_logits) record_prompt_logprobs(*seq, batch[i], i, seq->num_computed);
    seq->num_computed += plan.chunks[i].n_tokens;
    publish_prefix(*seq);
    if (seq->num_pending() == 0) on_logits(seq, logits_.last(i, batch));
  }
  local_.busy_seconds += timer.seconds();
  publish_stats();
  return true;
}

bool Engine::forward(SchedulePlan& plan, std::vector<BatchEntry>& batch) {
  for (;;) {
    batch.assign(plan.chunks.size(), BatchEntry{});
    for (size_t i = 0; i < plan.chunks.size(); ++i) {
      Sequence* seq = plan.chunks[i].seq;
      batch[i].table = &seq->table;
      batch[i].policy = seq->policy.get();
      batch[i].decode = seq->decoding();
      batch[i].all_logits = seq->request().prompt_logprobs && seq->num_computed < seq->num_prompt();
      batch[i].tokens =
          std::span<const int32_t>(seq->tokens().data() + seq->num_computed, size_t(plan.chunks[i].n_tokens));
    }
    if (batch_hook_) batch_hook_(batch);
    try {
      transformer_.forward(batch, cache_, logits_);
      return true;
    } catch (const BatchEntryError& e) {
      const ScheduledChunk bad = plan.chunks[e.entry()];
      plan.chunks.erase(plan.chunks.begin() + std::ptrdiff_t(e.entry()));
      plan.prefill_tokens -= bad.prefill_tokens;
      finish(bad.seq, FinishReason::Error, -1, {}, e.what());
      if (!e.others_untouched()) {
        // The pass wrote the others' KV past their committed tokens and fed
        // their policies (or committed them, if an after_forward threw), and
        // neither can be rolled back: computed again from scratch, they end
        // as they would have.
        for (const ScheduledChunk& c : plan.chunks) scheduler_.preempt(c.seq);
        local_.preemptions += int64_t(plan.chunks.size());
        plan.chunks.clear();
      }
      if (plan.chunks.empty()) return false;
    } catch (const std::exception& e) {
      // Not one entry's (Transformer::forward names the entry for every
      // error it can trace to one): the whole batch fails, and the engine
      // goes on with the sequences outside it, whose state this step never
      // touched. Not only kvserve::Error: std::bad_alloc, or a library's
      // exception from a thread-pool job, would end the process on the
      // engine thread.
      const bool ours = dynamic_cast<const Error*>(&e) != nullptr;
      const std::string message = ours ? e.what() : fmt::format("internal error in the forward pass: {}", e.what());
      for (const ScheduledChunk& c : plan.chunks) finish(c.seq, FinishReason::Error, -1, {}, message);
      return false;
    }
  }
}

void Engine::publish_stats() {
  local_.running = int32_t(scheduler_.num_running());
  local_.waiting = int32_t(scheduler_.num_waiting());
  local_.kv = cache_.stats();
  if (prefix_) local_.prefix = prefix_->stats();
  // The tiers' counters are read by stats() when asked, not every step.
  waiting_.store(local_.waiting);
  std::lock_guard<std::mutex> lock(stats_mutex_);
  const int64_t rejected = stats_.requests_rejected;  // counted by submit, under this mutex
  const int64_t cancels = stats_.cancels_requested;   // counted by cancel, under this mutex
  stats_ = local_;
  stats_.requests_rejected = rejected;
  stats_.cancels_requested = cancels;
}

EngineStats Engine::stats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    s = stats_;
  }
  // The tiers' writer runs on while the engine idles: read its counters now,
  // not as of the last step.
  // Written (the engine is the store's only put() caller) is capped by
  // queued, which is as of the last step: blocks the writer stored from a
  // step not yet published show at the next one.
  if (store_) {
    s.tier = store_->stats();
    s.tier_blocks_written = std::min(int64_t(s.tier.written), s.tier_blocks_queued);
  }
  return s;
}

void Engine::flush_tiers() {
  if (store_) store_->flush();
}

void Engine::run_until_idle() {
  while (step()) {
  }
}

void Engine::start() {
  if (started_.exchange(true)) fail("the engine is already running");
  thread_ = std::thread([this] {
    bool worked = false;  // the last step ran the model: more work may follow without new input
    while (true) {
      {
        std::unique_lock<std::mutex> lock(inbox_mutex_);
        inbox_cv_.wait(lock, [&] { return worked || stopping_ || !inbox_.requests.empty() || !inbox_.cancels.empty(); });
        if (stopping_ && (!drain_ || (sequences_.empty() && inbox_.requests.empty()))) break;
      }
      worked = run_step();
    }
    // Whatever is left is cancelled so every request gets its final event.
    absorb_inbox();
    std::vector<Sequence*> left;
    for (auto& [id, seq] : sequences_) left.push_back(seq.get());
    for (Sequence* seq : left) finish(seq, FinishReason::Cancelled, -1, seq->take_held_text());
    publish_stats();
  });
}

void Engine::shutdown(bool drain) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    stopping_ = true;
    drain_ = drain;
    inbox_cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvserve
