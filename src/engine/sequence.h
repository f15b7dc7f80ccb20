// One request inside the engine: its tokens, how many of them have KV in the
// cache, its block table, its sampler, and the text it has emitted.
//
// Invariant: the KV of tokens[0, num_computed) has been written to the cache
// (table.num_tokens == num_computed while Running, unless an evicting
// sparsity policy has dropped some: then the table holds fewer). Tokens past num_computed are "pending": the
// rest of the prompt while prefilling, or the one newest sampled token while
// decoding. A step runs some pending tokens; when it runs the last one, the
// logits give the next token. Preemption by recompute sets num_computed back
// to 0: the prompt and the tokens generated so far are prefilled again, or,
// under a sparsity policy (fixed_steps()), the prompt is prefilled and the
// generated tokens are replayed one decode step each.
//
// Under a sparsity policy the KV depends on how it was computed: an evicting
// policy evicts after every pass, and topk/ann choose reads for decode
// queries only. So such a sequence runs its prompt in chunks at fixed
// boundaries (every max_batch_prefill_tokens from its start, never a chunk
// cut short by a budget other sequences share) and its generated tokens one
// step each, also after a preemption: its output is its output alone
// (generate() with the same chunk size), whatever the load.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/request.h"
#include "engine/sampler.h"
#include "kv/block_table.h"
#include "kv/prefix_cache.h"

namespace kvserve {

enum class SequenceState : uint8_t { Waiting, Running, Finished };

class Sequence {
 public:
  // `order` is the arrival rank: lower is older and has priority.
  Sequence(RequestId id, Request request, uint64_t order, double arrival_seconds);

  RequestId id() const { return id_; }
  const Request& request() const { return request_; }
  uint64_t order() const { return order_; }
  double arrival_seconds() const { return arrival_seconds_; }

  const std::vector<int32_t>& tokens() const { return tokens_; }
  int32_t num_prompt() const { return num_prompt_; }
  int32_t num_generated() const { return int32_t(tokens_.size()) - num_prompt_; }
  int32_t num_pending() const { return int32_t(tokens_.size()) - num_computed; }
  // Whether the tokens known at admission all have KV, so the sequence produces
  // one token per step.
  bool decoding() const { return num_computed >= prefill_end; }
  // Most tokens the next prefill chunk may run: up to a prefix-cache
  // checkpoint first (see PrefixMatch::checkpoint_tokens), then all pending
  // up to prefill_end.
  int32_t chunk_limit() const {
    return std::min(checkpoint > num_computed ? checkpoint - num_computed : num_pending(), prefill_end - num_computed);
  }
  // See the file comment: prompt chunks at fixed boundaries, generated tokens one step each.
  bool fixed_steps() const { return policy != nullptr; }
  // The leading tokens whose KV is the same whoever computes it, which the
  // sequence may take from and give to the prefix cache: all of them under
  // full attention; under a policy that chooses decode reads (topk, ann) the
  // prompt only, since the KV of generated tokens then depends on those
  // choices (the policy reads a hit's keys from the cache: read_keys).
  int32_t shareable_tokens() const {
    return policy && policy->selects_reads() ? num_prompt_ : int32_t(tokens_.size());
  }

  // Result of adding a sampled token.
  struct Appended {
    std::string text;     // text safe to emit now (never part of a possible stop string)
    bool stopped = false; // a stop string matched: the sequence is done, text is cut before it
  };
  // Appends a sampled token and its text piece. A stop string ends the text
  // once min_tokens tokens are generated, also one that began before; text
  // that may begin one is held back from the first token on.
  Appended append(int32_t token, const std::string& piece);
  // Text still held back because it could begin a stop string (emitted at the end).
  std::string take_held_text();

  SequenceState state = SequenceState::Waiting;
  BlockTable table;                // the sequence's KV while Running
  int32_t num_computed = 0;        // tokens with KV in the cache
  int32_t prefill_end = 0;         // below it the sequence prefills: the tokens known at the last
                                   // admission (prompt, plus generated tokens after a preemption),
                                   // or the prompt alone with fixed_steps()
  int32_t cached_tokens = 0;       // prompt tokens served by the prefix cache at the first admission
  int32_t checkpoint = 0;          // end the first prefill chunk here (0 = no checkpoint)
  CacheScope scope;                // where the prefix cache looks up and publishes its blocks
  std::vector<BlockKey> keys;      // prefix-cache keys of the full blocks of tokens(), as far as computed
  int32_t skipped = 0;             // times prefix-aware ordering admitted a later request first
  int32_t preemptions = 0;
  bool cancel_requested = false;
  bool pinned = false;             // its prompt's blocks were pinned (pin_prefix)
  double first_token_seconds = 0;  // engine clock at the first generated token (0 = none yet)
  double last_token_seconds = 0;
  Sampler sampler;
  std::vector<TokenLogprobs> prompt_logprobs;  // Request::prompt_logprobs: prompt tokens 1.. so far
  bool prompt_logprobs_sent = false;           // they went out on the first event
  std::unique_ptr<SparsityPolicy> policy;  // null for "full": the forward pass does no extra work
  bool evicting() const { return policy && policy->evicts(); }

 private:
  RequestId id_;
  Request request_;
  uint64_t order_;
  double arrival_seconds_;
  std::vector<int32_t> tokens_;   // prompt, then generated tokens
  int32_t num_prompt_;
  std::string held_;              // generated text not yet emitted
};

}  // namespace kvserve
