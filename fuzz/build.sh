#!/usr/bin/env bash
# Builds the fuzz targets (checkpoint readers, KV store block records, HTTP
# request parsers) with clang + libFuzzer + ASan/UBSan, apart from the CMake
# build, and writes their seed corpora. See fuzz/README.md.
#
#   fuzz/build.sh [BUILD_DIR]       (default: build-fuzz/ in the source tree)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build-fuzz}
cxx=${CXX:-clang++-14}
mkdir -p "$out"

# Only what the readers need; nothing from the kernels' hot paths.
srcs=(
  src/model/gguf_reader.cpp src/model/model.cpp src/model/model_config.cpp
  src/model/tokenizer.cpp src/model/unicode_text.cpp src/model/gguf_writer.cpp
  src/model/synthetic_model.cpp src/model/ggml_dequantize.cpp src/model/ggml_quantize.cpp src/model/rope_scaling.cpp
  src/util/mapped_file.cpp src/kernels/vector_ops.cpp
  src/kernels/weight_matrix.cpp src/kernels/weight_quantize.cpp
  src/kernels/interleaved_weights.cpp src/kernels/quantize_q8.cpp src/util/thread_pool.cpp
)
common=(-std=c++20 -g -O1 -march=native -I"$root/src")
libs=(-lfmt -licuuc -lxxhash -pthread)

cd "$root"
"$cxx" "${common[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -fno-omit-frame-pointer fuzz/checkpoint_fuzz.cpp "${srcs[@]}" "${libs[@]}" -o "$out/checkpoint_fuzz"
"$cxx" "${common[@]}" -DKVSERVE_FUZZ_WRITE_SEEDS fuzz/checkpoint_fuzz.cpp "${srcs[@]}" "${libs[@]}" \
  -o "$out/checkpoint_fuzz_seeds"
rm -rf "$out/seeds"
"$out/checkpoint_fuzz_seeds" "$root" "$out/seeds"

# The KV store's block records: only the record code and xxHash.
# block_record.cpp uses BlockKey (src/kv/block_hash.cpp), which pulls in the
# KV codecs' descriptions.
record_srcs=(src/store/block_record.cpp src/kv/block_hash.cpp src/kv/kv_codec.cpp src/kv/float_codecs.cpp
  src/kv/int_codecs.cpp src/kv/outlier_codec.cpp src/kv/channel_codec.cpp src/kv/scale8.cpp
  src/kernels/vector_ops.cpp)
"$cxx" "${common[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -fno-omit-frame-pointer fuzz/block_record_fuzz.cpp "${record_srcs[@]}" -lfmt -lxxhash -lcrypto -o "$out/block_record_fuzz"
"$cxx" "${common[@]}" -DKVSERVE_FUZZ_WRITE_SEEDS fuzz/block_record_fuzz.cpp "${record_srcs[@]}" -lfmt -lxxhash -lcrypto \
  -o "$out/block_record_fuzz_seeds"
"$out/block_record_fuzz_seeds" "$out/seeds/records"

# The HTTP API's request parsers: only the protocol code (and what its
# sampler, request and UTF-8 types need).
request_srcs=(src/server/openai_protocol.cpp src/server/utf8_stream.cpp src/model/unicode_text.cpp src/engine/sampler.cpp)
"$cxx" "${common[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -fno-omit-frame-pointer fuzz/request_fuzz.cpp "${request_srcs[@]}" -lfmt -licuuc -o "$out/request_fuzz"
"$cxx" "${common[@]}" -DKVSERVE_FUZZ_WRITE_SEEDS fuzz/request_fuzz.cpp -lfmt -o "$out/request_fuzz_seeds"
"$out/request_fuzz_seeds" "$out/seeds/requests"
echo "built $out/{checkpoint_fuzz,block_record_fuzz,request_fuzz}; seeds in $out/seeds/{gguf,llama2c,records,requests}"
