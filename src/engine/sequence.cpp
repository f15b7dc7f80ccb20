#include "engine/sequence.h"

#include <algorithm>

namespace kvserve {

Sequence::Sequence(RequestId id, Request request, uint64_t order, double arrival_seconds)
    : sampler(request.sampling),
      id_(id),
      request_(std::move(request)),
      order_(order),
      arrival_seconds_(arrival_seconds),
      tokens_(request_.prompt),
      num_prompt_(int32_t(request_.prompt.size())) {
}

Sequence::Appended Sequence::append(int32_t token, const std::string& piece) {
  tokens_.push_back(token);
  const size_t before = held_.size();  // where the piece starts in held_
  held_ += piece;
  Appended out;
  // From min_tokens on, the earliest match of any stop string that ends in
  // this piece ends the text there (after it with include_stop_str; of two
  // matches at one place, the longer), even one that began before min_tokens
  // (vLLM looks back as far); one wholly before it never does.
  if (num_generated() >= request_.min_tokens) {
    size_t cut = std::string::npos, matched = 0;
    for (const std::string& s : request_.stop) {
      if (s.empty()) continue;
      const size_t at = held_.find(s, before + 1 > s.size() ? before + 1 - s.size() : 0);
      if (at < cut || (at == cut && at != std::string::npos && s.size() > matched)) cut = at, matched = s.size();
    }
    if (cut != std::string::npos) {
      out.text = held_.substr(0, request_.include_stop_str ? cut + matched : cut);
      held_.clear();
      out.stopped = true;
      return out;
    }
  }
  // Keep back the longest tail that is the beginning of a stop string (before
  // min_tokens too): it may still grow into one.
  size_t keep = 0;
  for (const std::string& s : request_.stop)
    for (size_t len = std::min(held_.size(), s.size() - 1); len > keep; --len)
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
  out.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string Sequence::take_held_text() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace kvserve
