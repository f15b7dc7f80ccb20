// libFuzzer target for the checkpoint and tokenizer readers: every input is
// offered, as a file, to Model::load, GgufFile (with its typed getters,
// matrix() and load_gguf_vocab) and load_llama2c_vocab. kvserve::Error is the
// one acceptable failure; any other exception, crash or sanitizer report is a
// bug. See fuzz/README.md.
//
// Built with -DKVSERVE_FUZZ_WRITE_SEEDS the same file is instead a small
// program that writes the seed corpus (tiny synthetic GGUFs of every weight
// type, a tiny llama2.c checkpoint, the real headers and tok512.bin).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "kernels/interleaved_weights.h"
#include "model/gguf_reader.h"
#include "model/model.h"
#include "model/synthetic_model.h"
#include "model/tokenizer.h"
#include "util/error.h"

namespace kvserve {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF"
constexpr int32_t kFuzzVocabSize = 512;      // tok512.bin's, so its seed parses

// Reads the first and last byte of n bytes at p, so a view that reaches past
// the mapping faults (or ASan reports) here rather than going unnoticed.
void touch(const void* p, size_t n) {
  if (n == 0) return;
  const auto* b = static_cast<const volatile uint8_t*>(p);
  (void)b[0];
  (void)b[n - 1];
}

// A matrix converted at load keeps only its interleaved copy (data is null).
void touch(const WeightMatrix& m) {
  if (m.data != nullptr) return touch(m.data, m.bytes());
  if (m.interleaved == nullptr) {
    std::fprintf(stderr, "a %lld x %lld matrix has neither data nor an interleaved copy\n", (long long)m.rows,
                 (long long)m.cols);
    std::abort();
  }
  touch(m.interleaved->qs.data(), m.interleaved->qs.size());
  touch(m.interleaved->d.data(), m.interleaved->d.size() * sizeof(uint16_t));
  touch(m.interleaved->m.data(), m.interleaved->m.size() * sizeof(uint16_t));  // Q4_1's mins; empty otherwise
}

void exercise_tokenizer(Vocab vocab) {
  Tokenizer tok(std::move(vocab));
  const std::vector<int32_t> ids = tok.encode("Once upon a time, \xE2\x96\x81 <0x0A>!", true);
  (void)tok.decode(ids);
}

void exercise_model(const std::string& path) {
  auto model = Model::load(path);
  const ModelConfig& c = model->config();
  const Weights& w = model->weights();
  touch(w.token_embedding);
  touch(w.classifier);
  touch(w.final_norm, size_t(c.dim) * sizeof(float));
  for (const LayerWeights& l : w.layers) {
    touch(l.attn_norm, size_t(c.dim) * sizeof(float));
    touch(l.ffn_norm, size_t(c.dim) * sizeof(float));
    for (const WeightMatrix* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_down, &l.w_up}) touch(*m);
  }
  if (model->tokenizer()) (void)model->tokenizer()->encode("hello", true);
}

void exercise_gguf(const std::string& path) {
  GgufFile f(path);
  for (const GgufTensorInfo& t : f.tensors()) {
    try {
      if (t.dims.size() == 2) touch(f.matrix(t.name, t.dims[1], t.dims[0]));
      if (t.dims.size() == 1) touch(f.vector_f32(t.name, t.dims[0]), size_t(t.dims[0]) * sizeof(float));
    } catch (const Error&) {
    }
  }
  for (const char* key : {"general.alignment", "llama.embedding_length", "llama.context_length"}) {
    try {
      (void)f.get_int_or(key, 0);
    } catch (const Error&) {
    }
  }
  exercise_tokenizer(load_gguf_vocab(f));
}

// The input as a file: an in-memory one, reached through /proc/self/fd.
class InputFile {
 public:
  InputFile() : fd_(memfd_create("kvserve_fuzz", 0)), path_("/proc/self/fd/" + std::to_string(fd_)) {
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
  }
  const std::string& write(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0 || (size > 0 && pwrite(fd_, data, size, 0) != ssize_t(size))) {
      std::perror("writing the fuzz input");
      std::abort();
    }
    return path_;
  }

 private:
  int fd_;
  std::string path_;
};

template <class F>
void expect_only_errors(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

}  // namespace
}  // namespace kvserve

#ifndef KVSERVE_FUZZ_WRITE_SEEDS

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvserve;
  static InputFile file;
  const std::string& path = file.write(data, size);
  uint32_t magic = 0;
  if (size >= 4) std::memcpy(&magic, data, 4);
  expect_only_errors([&] { exercise_model(path); });
  if (magic == kGgufMagic) expect_only_errors([&] { exercise_gguf(path); });
  expect_only_errors([&] { exercise_tokenizer(load_llama2c_vocab(path, kFuzzVocabSize)); });
  return 0;
}

#else  // KVSERVE_FUZZ_WRITE_SEEDS

namespace kvserve {
namespace {

std::string read_prefix(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open '{}'", path);
  std::string bytes(max_bytes, '\0');
  in.read(bytes.data(), std::streamsize(max_bytes));
  bytes.resize(size_t(in.gcount()));
  return bytes;
}

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out) fail("cannot write '{}'", path.string());
}

// A complete llama2.c checkpoint: dim 8, hidden 16, 1 layer, 2 heads, 1 KV
// head, vocab 8 (negative: separate classifier), seq_len 4.
std::string tiny_llama2c() {
  const int32_t h[7] = {8, 16, 1, 2, 1, -8, 4};
  const int64_t floats = 8 * 8 + (8 + 64 + 2 * 32 + 64 + 8 + 3 * 128) + 8 + 4 * 4 + 8 * 8;
  std::string out(reinterpret_cast<const char*>(h), sizeof h);
  for (int64_t i = 0; i < floats; ++i) {
    const float v = float(i % 17) * 0.0625f;
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  return out;
}

void write_seeds(const std::string& source_dir, const std::filesystem::path& out) {
  const std::filesystem::path gguf = out / "gguf", llama2c = out / "llama2c";
  std::filesystem::create_directories(gguf);
  std::filesystem::create_directories(llama2c);
  // Every type kvserve reads: in place, and converted at load (K-quants need
  // rows of 256 values).
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::BF16, GgmlType::Q4_1,
                     GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                     GgmlType::Q6_K}) {
    const int32_t width = int32_t(std::max<int64_t>(32, ggml_block(uint32_t(t)).values));
    SyntheticModelOptions o;
    o.dim = width;
    o.hidden_dim = width;
    o.n_layers = 1;
    o.n_heads = 2;
    o.n_kv_heads = 1;
    o.vocab_size = 8;
    o.seq_len = 16;
    o.weights = t;
    write_synthetic_gguf((gguf / ("synthetic_" + ggml_type_name(uint32_t(t)) + ".gguf")).string(), o);
  }
  // RoPE scaling: Llama 3.1's rope_freqs.weight, and the linear and YaRN keys.
  {
    SyntheticModelOptions o;
    o.dim = 32;
    o.hidden_dim = 32;
    o.n_layers = 1;
    o.n_heads = 2;
    o.n_kv_heads = 1;
    o.vocab_size = 8;
    o.seq_len = 64;
    o.weights = GgmlType::F32;
    o.rope_scaling.freq_factors = llama3_freq_factors(16, 10000.0f, 8.0f, 1.0f, 4.0f, 16);
    write_synthetic_gguf((gguf / "synthetic_rope_freqs.gguf").string(), o);
    o.rope_scaling.freq_factors.clear();
    o.rope_scaling.type = RopeScalingType::Yarn;
    o.rope_scaling.factor = 4.0f;
    o.rope_scaling.original_context = 16;
    o.rope_scaling.attn_factor = 0.9f;
    write_synthetic_gguf((gguf / "synthetic_rope_yarn.gguf").string(), o);
  }
  // The real GGUF's header and vocabulary, without most tensor data.
  write_file(gguf / "stories260K_head.gguf", read_prefix(source_dir + "/models/stories260K.gguf", 16384));
  write_file(llama2c / "tiny.bin", tiny_llama2c());
  write_file(llama2c / "stories260K_head.bin", read_prefix(source_dir + "/models/stories260K.bin", 4096));
  write_file(llama2c / "tok512.bin", read_prefix(source_dir + "/models/tok512.bin", 1 << 20));
}

}  // namespace
}  // namespace kvserve

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " SOURCE_DIR OUT_DIR\n";
    return 2;
  }
  try {
    kvserve::write_seeds(argv[1], argv[2]);
  } catch (const kvserve::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

#endif  // KVSERVE_FUZZ_WRITE_SEEDS
