// A loaded checkpoint: its shape, its weights (views into the mmap'd file or
// into owned buffers) and, when the file carries one, its vocabulary.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/weight_matrix.h"
#include "model/model_config.h"
#include "model/tokenizer.h"
#include "util/aligned_buffer.h"
#include "util/mapped_file.h"

namespace kvserve {

class GgufFile;
class ThreadPool;
struct InterleavedWeights;

struct LayerWeights {
  const float* attn_norm = nullptr;  // (dim)
  WeightMatrix wq;                   // (n_heads * head_dim, dim)
  WeightMatrix wk;                   // (kv_dim, dim)
  WeightMatrix wv;                   // (kv_dim, dim)
  WeightMatrix wo;                   // (dim, n_heads * head_dim)
  const float* ffn_norm = nullptr;   // (dim)
  WeightMatrix w_gate;               // (hidden_dim, dim)   "w1"
  WeightMatrix w_down;               // (dim, hidden_dim)   "w2"
  WeightMatrix w_up;                 // (hidden_dim, dim)   "w3"
};

struct Weights {
  WeightMatrix token_embedding;      // (vocab, dim)
  std::vector<LayerWeights> layers;  // (n_layers)
  const float* final_norm = nullptr; // (dim)
  WeightMatrix classifier;           // (vocab, dim); may alias token_embedding

  size_t bytes() const;              // all matrices and norms, in bytes
};

enum class CheckpointFormat { Gguf, Llama2c };

// Whether Model::load gives Q8_0/Q4_0/Q4_1 projections interleaved copies
// (kernels/interleaved_weights.h): the build has the kernel and
// KVSERVE_INTERLEAVE_WEIGHTS is not "0" (kept for A/B measurements).
bool loads_interleaved_weights();
// Whether Model::load computes Q4_1 and Q4_K tensors as Q4_1 (else as Q8_0):
// where the build has the Q4_1 kernel (native_q4_1_supported) and
// KVSERVE_INTERLEAVE_WEIGHTS is not "0".
bool loads_q4_1_natively();

// A GGUF tensor stored in a type kvserve does not compute with in place (the
// K-quants, Q4_1, Q5_0, Q5_1, BF16), converted at load: decoded row by row
// and re-encoded as `to` (Q8_0; F32 for BF16, exactly), or, where Q4_1 runs
// natively (Model::load), Q4_1 and Q4_K repacked as Q4_1 without decoding.
struct TensorConversion {
  std::string name;       // the GGUF tensor name
  uint32_t from = 0;      // its ggml type in the file
  WeightType to = WeightType::Q8_0;
};

// What a user may set over a checkpoint's own context and RoPE (llama.cpp's
// --ctx-size, --rope-freq-base, --rope-scaling, --rope-scale, --yarn-*):
// running a model past the context it was trained on. Unset fields keep the
// file's values.
struct ModelOverrides {
  std::optional<int32_t> context_length;
  std::optional<float> rope_freq_base;
  std::optional<RopeScalingType> rope_scaling;
  std::optional<float> rope_scale;  // the context factor (frequencies interpolated by 1 / it)
  std::optional<int32_t> yarn_original_context;
  std::optional<float> yarn_ext_factor, yarn_attn_factor, yarn_beta_fast, yarn_beta_slow;

  // Applies them to c (loaded from `source`, its seq_len the trained
  // context) and validates the result; throws kvserve::Error.
  void apply(ModelConfig& c, const std::string& source) const;
};

class Model {
 public:
  // Loads a GGUF (by magic) or llama2.c .bin checkpoint. A llama2.c checkpoint
  // has no vocabulary inside: pass its tokenizer .bin as tokenizer_path. For a
  // GGUF, a non-empty tokenizer_path overrides the embedded vocabulary.
  // Throws kvserve::Error on malformed files.
  static std::unique_ptr<Model> load(const std::string& path, const std::string& tokenizer_path = "",
                                     const ModelOverrides& overrides = {});

  const ModelConfig& config() const { return config_; }
  // The context the file declares; config().seq_len unless overridden.
  int32_t trained_context_length() const { return trained_context_; }
  const Weights& weights() const { return weights_; }
  CheckpointFormat format() const { return format_; }
  // Null when the checkpoint has no vocabulary and none was given.
  const Tokenizer* tokenizer() const { return tokenizer_ ? &*tokenizer_ : nullptr; }
  // REQUIRES: tokenizer() != nullptr; throws kvserve::Error otherwise.
  const Tokenizer& require_tokenizer() const;
  const std::string& path() const { return path_; }
  // Identity of the model for caches shared beyond one process: XXH3-128 of
  // the shape and of every weight byte, in hex (a converted tensor's bytes as
  // the file stores them). Same file, same fingerprint, wherever it is
  // loaded; computed on first call (reads all weights once).
  const std::string& fingerprint() const;
  // The tensors converted at load, in load order; empty for a checkpoint
  // whose weights are all read in place.
  std::vector<TensorConversion> conversions() const;

  Model();
  ~Model();

 private:
  // One converted tensor: the owned buffer its matrices point at, and its
  // bytes in the file (what fingerprint() hashes).
  struct Conversion {
    TensorConversion info;
    const uint8_t* source = nullptr;          // in the mapped file
    size_t source_bytes = 0;
    AlignedBuffer<uint8_t> buffer;            // (rows, weight_row_bytes(info.to, cols)); freed once
                                              // an interleaved copy replaces it
    std::vector<const WeightMatrix*> users;   // fields of weights_ pointing at buffer (the embedding
                                              // and a classifier tied to it share one)
  };

  void load_gguf(const std::string& path);
  void load_llama2c(const std::string& path);
  // out = the GGUF tensor `name` of shape (rows, cols): a view into the file
  // for types computed in place, else a converted copy this model owns.
  // pool: created on the first conversion, shared by the later ones.
  void load_gguf_matrix(const std::string& name, int64_t rows, int64_t cols, WeightMatrix& out,
                        std::unique_ptr<ThreadPool>& pool);
  // The conversion whose buffer w is (or was) read from; null for weights read in place.
  Conversion* conversion_of(const WeightMatrix& w) const;
  // Gives every Q8_0/Q4_0/Q4_1 projection its interleaved copy for the batched
  // kernel (kernels/interleaved_weights.h) and releases the mapped pages it
  // copied, or frees the converted buffer it copied (its matrix's data is
  // then null: matmul reads only the copy).
  // Skipped when the build lacks the kernel or KVSERVE_INTERLEAVE_WEIGHTS=0
  // (kept for A/B measurements).
  void interleave_weights();

  std::string path_;
  CheckpointFormat format_ = CheckpointFormat::Gguf;
  int32_t trained_context_ = 0;
  ModelConfig config_;
  Weights weights_;
  std::optional<Tokenizer> tokenizer_;
  std::unique_ptr<GgufFile> gguf_;        // keeps GGUF tensors mapped
  std::unique_ptr<MappedFile> raw_file_;  // keeps llama2.c tensors mapped
  std::vector<std::unique_ptr<InterleavedWeights>> interleaved_;  // owned copies the matrices point at
  std::vector<std::unique_ptr<Conversion>> conversions_;          // converted tensors, in load order
  mutable std::string fingerprint_;       // cached by fingerprint()
};

}  // namespace kvserve
