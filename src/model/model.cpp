#include "model/model.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "kernels/interleaved_weights.h"
#include "kernels/weight_quantize.h"
#include "model/ggml_dequantize.h"
#include "model/gguf_reader.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace kvserve {
namespace {

constexpr uint32_t kLlama2cVersionMagic = 0x616b3432;  // "ak42": llama2.c's versioned export

WeightMatrix f32_matrix(const float* data, int64_t rows, int64_t cols) {
  return WeightMatrix{WeightType::F32, data, rows, cols};
}

// A metadata integer bound for an int32 ModelConfig field. Without the check
// 2^32 + 64 would wrap to 64 and pass validate(); validate() checks the range.
int32_t narrow_i32(const std::string& path, const std::string& key, int64_t v) {
  if (v < INT32_MIN || v > INT32_MAX) fail("{}: metadata '{}' = {} is out of range", path, key, v);
  return int32_t(v);
}

// The head counts are metadata only the key projection can confirm: a wrong
// llama.attention.head_count changes the head dimension, and with it the
// rows attn_k should have (n_kv_heads * head_dim). Checked before RoPE, which
// reads the head dimension too, so the message names the head counts.
void check_head_counts(const GgufFile& f, const ModelConfig& c) {
  // A head dimension other than embedding_length / head_count (Mistral-Nemo:
  // 128, not 5120 / 32) is a model kvserve cannot run, not a wrong count.
  for (const char* key : {"llama.attention.key_length", "llama.attention.value_length"})
    if (f.has(key) && f.get_int(key) != c.head_dim())
      fail("{}: {} = {} differs from llama.embedding_length / llama.attention.head_count = {} / {} = {}: a head "
           "dimension of its own is not supported",
           f.path(), key, f.get_int(key), c.dim, c.n_heads, c.head_dim());
  const GgufTensorInfo* wk = f.find_tensor("blk.0.attn_k.weight");
  // A missing or otherwise malformed one: matrix() names it.
  if (wk == nullptr || wk->dims.size() != 2 || wk->dims[0] != c.dim || wk->dims[1] == c.kv_dim()) return;
  const bool kv_named = f.has("llama.attention.head_count_kv");
  fail("{}: tensor 'blk.0.attn_k.weight' has shape [{}, {}], expected [{}, {}]: llama.attention.head_count = {} "
       "gives a head dimension of {} (llama.embedding_length {} / {}), times llama.attention.head_count_kv = {}{}; "
       "a head count is inconsistent with the tensor's shape",
       f.path(), wk->dims[0], wk->dims[1], c.dim, c.kv_dim(), c.n_heads, c.head_dim(), c.dim, c.n_heads,
       c.n_kv_heads, kv_named ? "" : " (absent: head_count)");
}

}  // namespace

bool loads_interleaved_weights() {
  const char* env = std::getenv("KVSERVE_INTERLEAVE_WEIGHTS");
  return interleaved_weights_supported() && !(env != nullptr && std::string_view(env) == "0");
}

// Q4_1 loads only where its interleaved kernel exists and copies are made.
// Anywhere else a Q4_1 matrix would run on matmul's scalar row-major kernel,
// or, on the AVX-512 VNNI build, on no kernel that could be tested where it
// was written (native_q4_1_supported explains).
bool loads_q4_1_natively() { return native_q4_1_supported() && loads_interleaved_weights(); }

namespace {

// Whether a converted row (row_bytes bytes in type `to`) has a block scale
// or min fp16 cannot hold (ggml multiplies d by a sub-block's scale in fp32:
// a file's d past ~1040 overflows fp16 as Q4_1, values past ~8.3e6 as Q8_0).
// Such a block would compute inf, or NaN at a zero code. F32 rows: false.
bool has_infinite_scale(const uint8_t* row, size_t row_bytes, WeightType to) {
  if (to != WeightType::Q8_0 && to != WeightType::Q4_1) return false;
  const size_t block_bytes = weight_row_bytes(to, 32);
  const size_t scales = to == WeightType::Q4_1 ? 2 : 1;  // d (and m) lead each block
  for (size_t b = 0; b < row_bytes; b += block_bytes)
    for (size_t s = 0; s < scales; ++s) {
      uint16_t h;
      std::memcpy(&h, row + b + 2 * s, sizeof h);
      if ((h & 0x7C00) == 0x7C00) return true;
    }
  return false;
}

// Decodes the rows of tensor t, a (rows, cols) matrix of a type converted at
// load, and re-encodes each as `to` into out (rows * weight_row_bytes(to, cols)
// bytes); Q4_1 and Q4_K rows become Q4_1 without decoding. Returns the first
// row with a scale past fp16's range (has_infinite_scale), or -1. The reader
// checked that t's bytes lie in the file and match its shape and type, so
// every row read below is inside them.
int64_t convert_rows(const GgufTensorInfo& t, int64_t rows, int64_t cols, WeightType to, uint8_t* out,
                     ThreadPool& pool) {
  const GgmlBlock block = ggml_block(t.ggml_type);
  const size_t src_row = size_t(cols / block.values * block.bytes);
  const size_t dst_row = weight_row_bytes(to, cols);
  std::atomic<int64_t> first_bad{rows};
  pool.parallel_for(rows, 1, [&](int64_t begin, int64_t end, int) {
    std::vector<float> x;  // one decoded row
    std::vector<uint8_t> encoded;
    for (int64_t r = begin; r < end; ++r) {
      uint8_t* row = out + size_t(r) * dst_row;
      const uint8_t* src = t.data + size_t(r) * src_row;
      if (to == WeightType::Q4_1) {
        repack_ggml_row_q4_1(GgmlType(t.ggml_type), src, cols, row);
      } else {
        x.resize(size_t(cols));
        dequantize_ggml_row(GgmlType(t.ggml_type), src, cols, x.data());
        encoded.clear();
        quantize_row(to, x.data(), cols, encoded);
        std::memcpy(row, encoded.data(), dst_row);
      }
      if (has_infinite_scale(row, dst_row, to)) {
        int64_t seen = first_bad.load();
        while (r < seen && !first_bad.compare_exchange_weak(seen, r)) {
        }
      }
    }
  });
  return first_bad.load() < rows ? first_bad.load() : -1;
}

}  // namespace

Model::Model() = default;
Model::~Model() = default;

size_t Weights::bytes() const {
  size_t total = token_embedding.bytes();
  if (classifier.data != token_embedding.data) total += classifier.bytes();
  for (const auto& l : layers) {
    total += l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes();
    total += l.w_gate.bytes() + l.w_down.bytes() + l.w_up.bytes();
    total += 2 * size_t(token_embedding.cols) * sizeof(float);
  }
  return total + size_t(token_embedding.cols) * sizeof(float);
}

const std::string& Model::fingerprint() const {
  if (!fingerprint_.empty()) return fingerprint_;
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  const ModelConfig& c = config_;
  // The file's context, not one run with (--ctx-size): the same weights and
  // rotations make the same KV blocks and calibrations however long the run.
  const std::string shape = fmt::format("{} {} {} {} {} {} {} {} {} {}", c.architecture, c.dim, c.hidden_dim,
                                        c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, trained_context_,
                                        c.rope_theta, c.norm_eps);
  XXH3_128bits_update(state, shape.data(), shape.size());
  if (const RopeScaling& r = c.rope_scaling; r.scales()) {  // other rotations, other keys (unscaled: as before)
    const std::string rope = fmt::format(" rope {} {} {} {} {} {} {}", rope_scaling_name(r.type), r.factor,
                                         r.original_context, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow);
    XXH3_128bits_update(state, rope.data(), rope.size());
    XXH3_128bits_update(state, r.freq_factors.data(), r.freq_factors.size() * sizeof(float));
  }
  auto matrix = [&](const WeightMatrix& w) {
    if (const Conversion* c = conversion_of(w)) {
      // The file's bytes and the type they were converted to: the same file
      // gives the same fingerprint whether or not the converted copy was
      // replaced by an interleaved one, and another one where it computes as
      // another type (Q4_K as Q4_1 on AVX2, as Q8_0 elsewhere): replicas
      // sharing a KV tier share blocks only between equal weights.
      const int type = 1000 + 64 * int(c->info.from) + int(c->info.to);  // apart from WeightType's numbers
      XXH3_128bits_update(state, &type, sizeof type);
      XXH3_128bits_update(state, c->source, c->source_bytes);
      MappedFile::release(c->source, c->source_bytes);
      return;
    }
    const int type = int(w.type);
    XXH3_128bits_update(state, &type, sizeof type);
    XXH3_128bits_update(state, w.data, w.bytes());
    // Hashing paged the copied weights back in; drop them again.
    if (w.interleaved != nullptr && w.data != weights_.token_embedding.data) MappedFile::release(w.data, w.bytes());
  };
  auto norm = [&](const float* x) { XXH3_128bits_update(state, x, size_t(c.dim) * sizeof(float)); };
  matrix(weights_.token_embedding);
  for (const LayerWeights& l : weights_.layers) {
    norm(l.attn_norm);
    for (const WeightMatrix* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_down, &l.w_up}) matrix(*w);
    norm(l.ffn_norm);
  }
  norm(weights_.final_norm);
  matrix(weights_.classifier);
  const XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  fingerprint_ = fmt::format("{:016x}{:016x}", h.high64, h.low64);
  return fingerprint_;
}

std::vector<TensorConversion> Model::conversions() const {
  std::vector<TensorConversion> out;
  for (const auto& c : conversions_) out.push_back(c->info);
  return out;
}

Model::Conversion* Model::conversion_of(const WeightMatrix& w) const {
  for (const auto& c : conversions_)
    if (std::find(c->users.begin(), c->users.end(), &w) != c->users.end()) return c.get();
  return nullptr;
}

void Model::load_gguf_matrix(const std::string& name, int64_t rows, int64_t cols, WeightMatrix& out,
                             std::unique_ptr<ThreadPool>& pool) {
  const GgufTensorInfo& t = gguf_->matrix_tensor(name, rows, cols);
  if (!ggml_needs_conversion(t.ggml_type)) {
    out = gguf_->matrix(name, rows, cols);
    return;
  }
  auto c = std::make_unique<Conversion>();
  c->info = {name, t.ggml_type, *ggml_load_type(t.ggml_type, loads_q4_1_natively())};
  c->source = t.data;
  c->source_bytes = size_t(t.bytes);
  c->buffer.resize(weight_row_bytes(c->info.to, cols) * size_t(rows));
  if (!pool) pool = std::make_unique<ThreadPool>(int(std::max(1u, std::thread::hardware_concurrency())));
  if (const int64_t r = convert_rows(t, rows, cols, c->info.to, c->buffer.data(), *pool); r >= 0)
    fail("{}: tensor '{}' ({}) converted to {}: row {} has a block scale past fp16's range (65504); the file's "
           "values are not weights kvserve can compute with",
         gguf_->path(), name, ggml_type_label(t.ggml_type), weight_type_name(c->info.to), r);
  // The copy is what runs: the file's pages are not needed again (until
  // fingerprint() hashes them).
  MappedFile::release(t.data, size_t(t.bytes));
  out = WeightMatrix{c->info.to, c->buffer.data(), rows, cols};
  c->users.push_back(&out);
  conversions_.push_back(std::move(c));
}

const Tokenizer& Model::require_tokenizer() const {
  if (!tokenizer_) fail("{}: this checkpoint has no vocabulary; pass --tokenizer PATH", path_);
  return *tokenizer_;
}

void ModelOverrides::apply(ModelConfig& c, const std::string& source) const {
  const int32_t trained = c.seq_len;
  RopeScaling& r = c.rope_scaling;
  if (rope_freq_base) c.rope_theta = *rope_freq_base;
  // A factor alone stretches as linear, the type llama.cpp assumes when the
  // file names none.
  if (rope_scaling) r.type = *rope_scaling;
  else if (rope_scale && r.type == RopeScalingType::None) r.type = RopeScalingType::Linear;
  if (rope_scale) r.factor = *rope_scale;
  if (r.type == RopeScalingType::None) r.factor = 1.0f;
  if (r.type == RopeScalingType::Yarn && r.original_context == 0) r.original_context = trained;
  if (yarn_original_context) r.original_context = *yarn_original_context;
  if (yarn_ext_factor) r.ext_factor = *yarn_ext_factor;
  if (yarn_attn_factor) r.attn_factor = *yarn_attn_factor;
  if (yarn_beta_fast) r.beta_fast = *yarn_beta_fast;
  if (yarn_beta_slow) r.beta_slow = *yarn_beta_slow;
  // The ramp's knobs mean nothing without YaRN: refused, not ignored.
  if ((yarn_original_context || yarn_ext_factor || yarn_beta_fast || yarn_beta_slow) && r.type != RopeScalingType::Yarn)
    fail("{}: --yarn-orig-ctx, --yarn-ext-factor and --yarn-beta-* apply to YaRN only; this model's RoPE scaling is "
         "{} (add --rope-scaling yarn)",
         source, rope_scaling_name(r.type));
  if (context_length) c.seq_len = *context_length;
  c.validate(source);
}

std::unique_ptr<Model> Model::load(const std::string& path, const std::string& tokenizer_path,
                                   const ModelOverrides& overrides) {
  auto model = std::make_unique<Model>();
  model->path_ = path;
  bool gguf = false;
  {
    MappedFile probe(path);
    if (probe.size() < 4) fail("{}: file is too small to be a checkpoint ({} bytes)", path, probe.size());
    gguf = has_gguf_magic(probe.data(), probe.size());
  }
  if (gguf) {
    model->load_gguf(path);
  } else {
    model->load_llama2c(path);
  }
  model->trained_context_ = model->config_.seq_len;
  overrides.apply(model->config_, path);
  model->interleave_weights();
  if (!tokenizer_path.empty()) {
    // A GGUF file can serve as a tokenizer too (a vocab-only GGUF, say).
    Vocab vocab = has_gguf_magic(tokenizer_path) ? load_gguf_vocab(GgufFile(tokenizer_path))
                                                 : load_llama2c_vocab(tokenizer_path, model->config_.vocab_size);
    model->tokenizer_.emplace(std::move(vocab));
  }
  if (model->tokenizer_ && model->tokenizer_->vocab_size() != model->config_.vocab_size)
    fail("{}: tokenizer has {} tokens but the model's vocabulary is {}", path,
         model->tokenizer_->vocab_size(), model->config_.vocab_size);
  return model;
}

void Model::interleave_weights() {
  if (!loads_interleaved_weights()) return;
  std::vector<WeightMatrix*> todo;  // the block-quantized ones: no threads for a float model
  auto consider = [&](WeightMatrix* w) {
    if (w->type == WeightType::Q8_0 || w->type == WeightType::Q4_0 || w->type == WeightType::Q4_1)
      todo.push_back(w);
  };
  for (LayerWeights& l : weights_.layers)
    for (WeightMatrix* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_down, &l.w_up}) consider(w);
  consider(&weights_.classifier);
  if (todo.empty()) return;
  // Copying is bound by first writes to fresh pages (faults) and by the
  // shuffle: both spread over the cores.
  std::vector<std::unique_ptr<InterleavedWeights>> copies(todo.size());
  ThreadPool pool(int(std::max(1u, std::thread::hardware_concurrency())));
  pool.parallel_for(int64_t(todo.size()), 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) {
      WeightMatrix& w = *todo[size_t(i)];
      copies[size_t(i)] = make_interleaved(w);
      // Drop the copied bytes at once, so the two copies never all coexist. A
      // classifier tied to the embedding keeps them: lookups read them. A
      // converted matrix's buffer is heap memory: freed (advice to drop its
      // pages would zero them). Only this thread touches w and its
      // conversion's buffer; the users lists other threads read stay as they are.
      if (!copies[size_t(i)] || w.data == weights_.token_embedding.data) continue;
      if (Conversion* c = conversion_of(w)) {
        c->buffer = AlignedBuffer<uint8_t>();
        w.data = nullptr;
      } else {
        MappedFile::release(w.data, w.bytes());
      }
    }
  });
  for (size_t i = 0; i < todo.size(); ++i) {
    if (!copies[i]) continue;
    todo[i]->interleaved = copies[i].get();
    interleaved_.push_back(std::move(copies[i]));
  }
}

// RoPE scaling as llama.cpp reads it from a `llama` GGUF: a factor with no
// type means linear (its default type), "none" never scales, attn_factor
// scales the magnitude for any type, and
// rope_freqs.weight (Llama 3.1's per-pair divisors) applies whatever the
// type. Another type (longrope, ...) is refused: ignored, the model would
// run with wrong rotations past its first positions.
static RopeScaling read_rope_scaling(const GgufFile& f, const std::string& path, int head_dim,
                                     int32_t context_length) {
  RopeScaling s;
  double factor = f.get_float_or("llama.rope.scaling.factor", 0.0);
  if (factor == 0.0) factor = f.get_float_or("llama.rope.scale_linear", 0.0);  // the older key
  const std::string type = f.get_string_or("llama.rope.scaling.type", "linear");
  const std::optional<RopeScalingType> t = parse_rope_scaling_type(type);
  if (!t) fail("{}: RoPE scaling type '{}' (llama.rope.scaling.type) is not supported; kvserve runs none, linear and yarn", path, type);
  s.type = *t;
  s.factor = float(factor == 0.0 ? 1.0 : factor);
  if (s.type == RopeScalingType::Linear && s.factor == 1.0f) s.type = RopeScalingType::None;
  if (s.type == RopeScalingType::None) s.factor = 1.0f;
  if (s.type == RopeScalingType::Yarn) {
    // Absent: the trained context, fixed now so that a longer context asked
    // for at run time (ModelOverrides) does not move the ramp.
    const int64_t original = f.get_int_or("llama.rope.scaling.original_context_length", context_length);
    if (original <= 0 || original > (int64_t(1) << 30))
      fail("{}: llama.rope.scaling.original_context_length = {} is out of range", path, original);
    s.original_context = int32_t(original);
    // The yarn_* keys are left alone, as llama.cpp's llama loader leaves
    // them (its converter writes Hugging Face's whole mscale into
    // yarn_attn_factor, which read here would apply the log term twice):
    // ext_factor 1 and betas 32 / 1, or the --yarn-* flags.
  }
  s.attn_factor = float(f.get_float_or("llama.rope.scaling.attn_factor", 1.0));  // every type, as llama.cpp
  if (f.find_tensor("rope_freqs.weight") != nullptr) {
    const float* v = f.vector_f32("rope_freqs.weight", head_dim / 2);
    s.freq_factors.assign(v, v + head_dim / 2);
  }
  return s;
}

void Model::load_gguf(const std::string& path) {
  format_ = CheckpointFormat::Gguf;
  gguf_ = std::make_unique<GgufFile>(path);
  const GgufFile& f = *gguf_;
  std::string arch = f.get_string_or("general.architecture", "");
  if (arch.empty()) fail("{}: missing general.architecture", path);
  if (f.tensors().empty()) fail("{}: no tensors (a vocabulary-only GGUF cannot run; use it as --tokenizer)", path);
  if (arch != "llama") fail("{}: architecture '{}' is not supported (kvserve runs 'llama')", path, arch);

  ModelConfig& c = config_;
  c.architecture = arch;
  auto int_key = [&](const std::string& key) { return narrow_i32(path, key, f.get_int(key)); };
  auto int_key_or = [&](const std::string& key, int64_t fallback) {
    return narrow_i32(path, key, f.get_int_or(key, fallback));
  };
  c.dim = int_key("llama.embedding_length");
  c.hidden_dim = int_key("llama.feed_forward_length");
  c.n_layers = int_key("llama.block_count");
  c.n_heads = int_key("llama.attention.head_count");
  c.n_kv_heads = int_key_or("llama.attention.head_count_kv", c.n_heads);
  c.seq_len = int_key("llama.context_length");
  c.rope_theta = float(f.get_float_or("llama.rope.freq_base", 10000.0));
  c.norm_eps = float(f.get_float_or("llama.attention.layer_norm_rms_epsilon", 1e-5));
  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  if (emb == nullptr || emb->dims.size() != 2) fail("{}: missing or malformed token_embd.weight", path);
  c.vocab_size = int_key_or("llama.vocab_size", emb->dims[1]);
  // validate() names ModelConfig's fields; a GGUF's user looks for the keys.
  if (c.dim > 0 && c.n_heads > 0 && c.dim % c.n_heads != 0)
    fail("{}: llama.attention.head_count = {} does not divide llama.embedding_length = {} into whole heads", path,
         c.n_heads, c.dim);
  if (c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads != 0)
    fail("{}: llama.attention.head_count = {} is not a multiple of llama.attention.head_count_kv = {}", path,
         c.n_heads, c.n_kv_heads);
  c.validate(path);
  // GGUF lists dims innermost first: [dim, vocab]. A transposed embedding
  // gives its dim as the vocabulary size above, and matrix() then compared
  // [vocab, dim] with [dim, dim], a message naming neither cause.
  if (emb->dims[0] != c.dim) {
    if (emb->dims[1] == c.dim)
      fail("{}: tensor 'token_embd.weight' has shape [{}, {}]: it appears transposed (expected [{}, {}]: "
           "llama.embedding_length first, then the vocabulary size)",
           path, emb->dims[0], emb->dims[1], c.dim, emb->dims[0]);
    fail("{}: tensor 'token_embd.weight' has shape [{}, {}], expected [{}, vocabulary size] (llama.embedding_length "
         "= {})",
         path, emb->dims[0], emb->dims[1], c.dim, c.dim);
  }
  check_head_counts(f, c);
  int64_t rope_dims = f.get_int_or("llama.rope.dimension_count", c.head_dim());
  if (rope_dims != c.head_dim())
    fail("{}: llama.rope.dimension_count = {} but the head dimension is {} (llama.embedding_length {} / "
         "llama.attention.head_count {}): a wrong head_count, or partial rotary embedding ({} of {} dims), which "
         "is not supported",
         path, rope_dims, c.head_dim(), c.dim, c.n_heads, rope_dims, c.head_dim());
  c.rope_scaling = read_rope_scaling(f, path, c.head_dim(), c.seq_len);
  c.rope_scaling.validate(path, c.head_dim());

  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim();
  std::unique_ptr<ThreadPool> pool;  // for conversions, created by the first
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols, WeightMatrix& out) {
    load_gguf_matrix(name, rows, cols, out, pool);
  };
  matrix("token_embd.weight", c.vocab_size, c.dim, weights_.token_embedding);
  weights_.final_norm = f.vector_f32("output_norm.weight", c.dim);
  if (f.find_tensor("output.weight")) {
    matrix("output.weight", c.vocab_size, c.dim, weights_.classifier);
  } else {
    weights_.classifier = weights_.token_embedding;
    if (Conversion* e = conversion_of(weights_.token_embedding)) e->users.push_back(&weights_.classifier);
  }
  // Sized once: the conversions point at these fields.
  weights_.layers.resize(size_t(c.n_layers));
  for (int32_t l = 0; l < c.n_layers; ++l) {
    auto name = [&](const char* what) { return fmt::format("blk.{}.{}.weight", l, what); };
    LayerWeights& w = weights_.layers[size_t(l)];
    w.attn_norm = f.vector_f32(name("attn_norm"), c.dim);
    matrix(name("attn_q"), q_dim, c.dim, w.wq);
    matrix(name("attn_k"), c.kv_dim(), c.dim, w.wk);
    matrix(name("attn_v"), c.kv_dim(), c.dim, w.wv);
    matrix(name("attn_output"), c.dim, q_dim, w.wo);
    w.ffn_norm = f.vector_f32(name("ffn_norm"), c.dim);
    matrix(name("ffn_gate"), c.hidden_dim, c.dim, w.w_gate);
    matrix(name("ffn_down"), c.dim, c.hidden_dim, w.w_down);
    matrix(name("ffn_up"), c.hidden_dim, c.dim, w.w_up);
  }
  // Every tensor must be one the graph above reads: another (a layer past
  // block_count, rope_freqs.weight, a bias) would be silently left out.
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.name == "token_embd.weight" || t.name == "output_norm.weight" || t.name == "output.weight" ||
        t.name == "rope_freqs.weight")
      continue;
    int32_t layer = -1;
    char part[32] = {};
    if (std::sscanf(t.name.c_str(), "blk.%d.%31[a-z_].weight", &layer, part) == 2 && layer >= 0 &&
        layer < c.n_layers && t.name == fmt::format("blk.{}.{}.weight", layer, part)) {
      static constexpr std::string_view kParts[] = {"attn_norm", "attn_q", "attn_k",   "attn_v", "attn_output",
                                                    "ffn_norm",  "ffn_gate", "ffn_down", "ffn_up"};
      if (std::find(std::begin(kParts), std::end(kParts), std::string_view(part)) != std::end(kParts)) continue;
    }
    fail("{}: tensor '{}' is not part of the llama graph kvserve runs ({} layers); the model needs what kvserve "
         "does not implement",
         path, t.name, c.n_layers);
  }
  if (f.has("tokenizer.ggml.model")) tokenizer_.emplace(load_gguf_vocab(f));
}

void Model::load_llama2c(const std::string& path) {
  format_ = CheckpointFormat::Llama2c;
  raw_file_ = std::make_unique<MappedFile>(path);
  const uint8_t* base = raw_file_->data();
  const size_t size = raw_file_->size();
  constexpr size_t kHeaderBytes = 7 * sizeof(int32_t);
  if (size < kHeaderBytes) fail("{}: too small for a llama2.c header ({} bytes)", path, size);
  int32_t h[7];
  std::memcpy(h, base, sizeof h);
  if (uint32_t(h[0]) == kLlama2cVersionMagic)
    fail("{}: llama2.c versioned export (magic 'ak42') is not supported; export with the legacy format", path);

  ModelConfig& c = config_;
  c.architecture = "llama";
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  // A negative vocabulary size marks a separate (unshared) classifier.
  const bool shared_classifier = h[5] > 0;
  c.vocab_size = h[5] == INT32_MIN ? 0 : (h[5] > 0 ? h[5] : -h[5]);
  c.seq_len = h[6];
  c.validate(path + " (llama2.c header; is this a checkpoint?)");

  const int64_t dim = c.dim, hidden = c.hidden_dim, layers = c.n_layers, kv_dim = c.kv_dim();
  const int64_t head = c.head_dim(), vocab = c.vocab_size, seq = c.seq_len;
  // Float counts of each section, in file order.
  const int64_t per_layer = dim + dim * dim + 2 * dim * kv_dim + dim * dim + dim + 3 * dim * hidden;
  const int64_t expected = vocab * dim + layers * per_layer + dim + seq * head +
                           (shared_classifier ? 0 : vocab * dim);
  // Exactly: a header whose shape differs from the weights' (n_layers or
  // n_heads off) could otherwise read the floats as other tensors.
  const int64_t have = int64_t((size - kHeaderBytes) / sizeof(float));
  if (have < expected)
    fail("{}: truncated llama2.c checkpoint: header implies {} floats, file holds {}", path, expected, have);
  if (have > expected || (size - kHeaderBytes) % sizeof(float) != 0)
    fail("{}: llama2.c checkpoint holds {} bytes after its header; the header (dim {}, hidden {}, {} layers, {} heads, "
         "{} KV heads, vocab {}, seq {}) implies {} floats ({} bytes): a wrong header or a file of another format",
         path, size - kHeaderBytes, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len,
         expected, expected * int64_t(sizeof(float)));

  const float* p = reinterpret_cast<const float*>(base + kHeaderBytes);
  auto take = [&](int64_t count) { const float* at = p; p += count; return at; };
  weights_.token_embedding = f32_matrix(take(vocab * dim), vocab, dim);
  weights_.layers.resize(size_t(layers));
  // llama2.c groups each tensor kind across all layers.
  for (auto& w : weights_.layers) w.attn_norm = take(dim);
  for (auto& w : weights_.layers) w.wq = f32_matrix(take(dim * dim), dim, dim);
  for (auto& w : weights_.layers) w.wk = f32_matrix(take(kv_dim * dim), kv_dim, dim);
  for (auto& w : weights_.layers) w.wv = f32_matrix(take(kv_dim * dim), kv_dim, dim);
  for (auto& w : weights_.layers) w.wo = f32_matrix(take(dim * dim), dim, dim);
  for (auto& w : weights_.layers) w.ffn_norm = take(dim);
  for (auto& w : weights_.layers) w.w_gate = f32_matrix(take(hidden * dim), hidden, dim);
  for (auto& w : weights_.layers) w.w_down = f32_matrix(take(dim * hidden), dim, hidden);
  for (auto& w : weights_.layers) w.w_up = f32_matrix(take(hidden * dim), hidden, dim);
  weights_.final_norm = take(dim);
  take(seq * head);  // freq_cis_real and freq_cis_imag (seq, head/2) each: recomputed instead
  weights_.classifier = shared_classifier ? weights_.token_embedding : f32_matrix(take(vocab * dim), vocab, dim);
}

}  // namespace kvserve
