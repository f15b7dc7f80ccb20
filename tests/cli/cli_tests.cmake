# End-to-end checks of the kvserve CLI: exact greedy outputs against the
# llama2.c reference texts in ../shared/data/reference, and clean errors.
set(REF "${KVSERVE_SHARED_DIR}/data/reference")
set(MODELS "${CMAKE_SOURCE_DIR}/models")
set(SHARED_MODELS "${KVSERVE_SHARED_DIR}/models")

function(kvserve_output_test name expected)
  add_test(NAME ${name} COMMAND ${CMAKE_COMMAND} "-DCOMMAND=$<TARGET_FILE:kvserve>;${ARGN}"
           -DEXPECTED=${expected} -P ${CMAKE_SOURCE_DIR}/tests/cli/compare_output.cmake)
endfunction()

function(kvserve_error_test name expect)
  add_test(NAME ${name} COMMAND ${CMAKE_COMMAND} "-DCOMMAND=$<TARGET_FILE:kvserve>;${ARGN}"
           "-DEXPECT=${expect}" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_error.cmake)
endfunction()

set(ONCE "Once upon a time")
kvserve_output_test(cli.generate_stories_bin_256 ${REF}/stories260K_greedy_once_upon_a_time_256.txt
  generate --model ${MODELS}/stories260K.bin --tokenizer ${MODELS}/tok512.bin --prompt ${ONCE} --max-tokens 256 --temperature 0)
kvserve_output_test(cli.generate_stories_gguf_256 ${REF}/stories260K_greedy_once_upon_a_time_256.txt
  generate --model ${MODELS}/stories260K.gguf --prompt ${ONCE} --max-tokens 256 --temperature 0)
kvserve_output_test(cli.generate_stories_gguf_256_fp16_block7 ${REF}/stories260K_greedy_once_upon_a_time_256.txt
  generate --model ${MODELS}/stories260K.gguf --prompt ${ONCE} --max-tokens 256 --temperature 0 --kv-dtype fp16 --block-size 7)
kvserve_output_test(cli.generate_stories_bin_noprompt_200 ${REF}/stories260K_greedy_noprompt_200.txt
  generate --model ${MODELS}/stories260K.bin --tokenizer ${MODELS}/tok512.bin --max-tokens 200 --temperature 0)
kvserve_output_test(cli.generate_stories_gguf_noprompt_200 ${REF}/stories260K_greedy_noprompt_200.txt
  generate --model ${MODELS}/stories260K.gguf --max-tokens 200 --temperature 0)
kvserve_output_test(cli.generate_aidreams_bin_128 ${REF}/aidreams260K_greedy_once_upon_a_time_128.txt
  generate --model ${SHARED_MODELS}/aidreams260K.bin --tokenizer ${SHARED_MODELS}/aidreams_tok512.bin --prompt ${ONCE} --max-tokens 128 --temperature 0)
kvserve_output_test(cli.generate_aidreams_gguf_128 ${REF}/aidreams260K_greedy_once_upon_a_time_128.txt
  generate --model ${SHARED_MODELS}/aidreams260K.gguf --prompt ${ONCE} --max-tokens 128 --temperature 0)

kvserve_error_test(cli.error_missing_model "cannot open"
  generate --model ${MODELS}/does_not_exist.gguf --prompt x --max-tokens 8)
kvserve_error_test(cli.error_text_file_is_a_directory "--file '${MODELS}' is not a regular file"
  perplexity --model ${MODELS}/stories260K.gguf --file ${MODELS} --ctx 64)
kvserve_error_test(cli.error_not_a_checkpoint "llama2.c header"
  generate --model ${MODELS}/README.md --tokenizer ${MODELS}/tok512.bin --prompt x --max-tokens 8)
kvserve_error_test(cli.error_bin_without_tokenizer "--tokenizer"
  generate --model ${MODELS}/stories260K.bin --prompt x --max-tokens 8)
kvserve_error_test(cli.error_max_tokens_past_context "context length"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 100000)
kvserve_error_test(cli.error_kv_too_small "cannot hold"
  generate --model ${MODELS}/stories260K.gguf --prompt ${ONCE} --max-tokens 256 --kv-blocks 2)
# Arguments CLI11 refuses are errors like the others: one "kvserve: error:"
# line and status 1 (they printed two other lines and exited 104-114).
kvserve_error_test(cli.error_unconvertible_value "Could not convert: --max-tokens = abc"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens abc)
# httplib bound a port past 65535 modulo 2^16 while the server printed the
# value given; NaN passed every range check.
kvserve_error_test(cli.serve_error_port_out_of_range "--port: Value 70000 not in range"
  serve --model ${MODELS}/stories260K.gguf --port 70000)
kvserve_error_test(cli.serve_error_drain_timeout_nan "--drain-timeout: must be a finite number in [0, 1000000] (got 'nan')"
  serve --model ${MODELS}/stories260K.gguf --drain-timeout nan)
# Sampled byte tokens that end mid-character (near-uniform sampling makes
# many): --json printed nothing and failed on the invalid UTF-8.
add_test(NAME cli.generate_json_invalid_utf8_text COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;generate;--model;${MODELS}/stories260K.gguf;--prompt;x;--temperature;50;--seed;1;--max-tokens;40;--json"
  "-DFIELDS=text;tokens" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
kvserve_error_test(cli.tokenize_error_llama2c_checkpoint_needs_tokenizer "pass --tokenizer PATH"
  tokenize --model ${MODELS}/stories260K.bin --file ${CMAKE_SOURCE_DIR}/tests/cli/hello_world.txt)
kvserve_error_test(cli.error_bad_dtype "unknown KV dtype"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int3)
kvserve_error_test(cli.error_block_size_zero "block-size"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --block-size 0)
kvserve_error_test(cli.error_small_preset_block_size_zero "block-size"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-preset int4-small --block-size 0)
kvserve_error_test(cli.error_scale_bits "scale-bits"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int4 --kv-scale-bits 12)
kvserve_error_test(cli.error_eight_bit_scales_without_window "residual window"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int4 --kv-scale-bits 8 --kv-residual 0)
kvserve_error_test(cli.error_rope_span_without_pre_rope "applies to keys stored before RoPE"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-preset int4 --kv-k-rope-span 16)
kvserve_error_test(cli.error_rope_span_not_dividing_block "must divide the block size 32"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-preset int2 --kv-k-rope-span 24)
kvserve_error_test(cli.error_rope_span_negative "--kv-k-rope-span must be >= 1"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-preset int2 --kv-k-rope-span -1)
# Numbers a flag was given are checked, even the old "not given" sentinels
# (-1 for the group sizes, -2 for the window, 0 for scale bits).
kvserve_error_test(cli.error_kv_group_negative "--kv-group must be >= 0"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int4 --kv-group -1)
kvserve_error_test(cli.error_kv_v_group_negative "--kv-v-group must be >= 0"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int4 --kv-v-group -4)
kvserve_error_test(cli.error_kv_residual_negative "--kv-residual must be >= 0"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int4 --kv-residual -2)
kvserve_error_test(cli.error_scale_bits_zero "--kv-scale-bits must be 16 or 8"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int4 --kv-scale-bits 0)
kvserve_error_test(cli.error_rope_span_zero "--kv-k-rope-span must be >= 1"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-preset int2 --kv-k-rope-span 0)
# A bit budget that no assignment can meet fails before the sensitivity runs.
kvserve_error_test(cli.error_calibrate_kv_bits_negative "--kv-bits must be 0"
  calibrate --model ${MODELS}/stories260K.gguf --data ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt
  --out calib_unused.json --ctx 64 --chunks 1 --kv-bits -3)
kvserve_error_test(cli.error_calibrate_kv_bits_below_int2 "narrowest candidate type has 2 bits"
  calibrate --model ${MODELS}/stories260K.gguf --data ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt
  --out calib_unused.json --ctx 64 --chunks 1 --kv-bits 1.5)
kvserve_error_test(cli.error_ppl_chunks_below_minus_one "--chunks must be positive, or -1"
  perplexity --model ${MODELS}/stories260K.gguf --file ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt --ctx 64 --chunks -5)
kvserve_error_test(cli.error_bench_compare_block_size_zero "--compare-block-size 0 is out of range"
  bench --model ${MODELS}/stories260K.gguf --compare-preset fp16 --compare-block-size 0 --prompt-tokens 8 --gen-tokens 2)
kvserve_error_test(cli.error_bench_fill_past_context "--fill-context + --prompt-tokens + --gen-tokens"
  bench --model ${MODELS}/stories260K.gguf --fill-context 600 --prompt-tokens 8 --gen-tokens 2)
kvserve_error_test(cli.error_threads_past_limit "--threads must be in 0..1024"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --threads 10000)
kvserve_error_test(cli.error_kv_memory_zero "--kv-memory must be positive"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-memory 0)
kvserve_error_test(cli.error_kv_blocks_zero "--kv-blocks must be positive"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-blocks 0)
kvserve_error_test(cli.error_kv_blocks_and_memory "not both"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-blocks 5 --kv-memory 1MiB)
kvserve_error_test(cli.error_kv_layers_negative "is not a layer or a range of layers"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-layers -1:fp16)
kvserve_error_test(cli.error_kv_calibration_directory "is a directory"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int4 --kv-calibration ${MODELS})
kvserve_error_test(cli.error_calibrate_percentile_nan "--percentile must be in"
  calibrate --model ${MODELS}/stories260K.gguf --data ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt
  --out calib_unused.json --ctx 64 --chunks 1 --percentile nan)
kvserve_error_test(cli.error_ppl_ctx_overflow "--ctx 2147483647 is out of range"
  perplexity --model ${MODELS}/stories260K.gguf --file ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt --ctx 2147483647)
kvserve_error_test(cli.error_bench_bandwidth_zero "--bandwidth-mib must be in"
  bench --model ${MODELS}/stories260K.gguf --prompt-tokens 8 --gen-tokens 2 --bandwidth-mib 0)
kvserve_error_test(cli.error_bench_compare_block_size_large "--compare-block-size 100000 is out of range"
  bench --model ${MODELS}/stories260K.gguf --compare-preset int4 --compare-block-size 100000 --prompt-tokens 8 --gen-tokens 2)
# A calibration with a per-layer assignment (calibrate --kv-bits 4 on the
# TinyStories head, 2 chunks of 64) sets every layer's types: an explicit
# type as well is an error, --kv-layers overrides apply, and outliers asked
# for all layers stay on the integer ones.
set(MIXED_CALIB ${CMAKE_SOURCE_DIR}/tests/cli/stories260K_mixed4_calibration.json)
kvserve_error_test(cli.error_kv_dtype_with_assignment "assigns each layer's KV types"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype fp16 --kv-calibration ${MIXED_CALIB})
add_test(NAME cli.kv_layers_and_outliers_over_an_assignment
  COMMAND kvserve generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8
  --kv-calibration ${MIXED_CALIB} --kv-layers 0:fp16 --kv-k-outliers 1)
set_tests_properties(cli.kv_layers_and_outliers_over_an_assignment PROPERTIES PASS_REGULAR_EXPRESSION "0:fp16, 1:K int4/static\\+o1")
# A file from calibrate --kv-bits records the layout it was measured with
# (channel keys before RoPE, a 32-token window, dynamic scales): the file
# alone runs it, flags given override parts of it, and a file whose recorded
# model is another one is refused.
set(LAYOUT_CALIB ${CMAKE_SOURCE_DIR}/tests/cli/stories260K_mixed3_layout_calibration.json)
add_test(NAME cli.calibration_applies_its_recorded_layout
  COMMAND kvserve inspect --model ${MODELS}/stories260K.gguf --kv-calibration ${LAYOUT_CALIB} --json)
set_tests_properties(cli.calibration_applies_its_recorded_layout PROPERTIES
  PASS_REGULAR_EXPRESSION "\"kv_dtype\":\"K int4/channel/g16\\+prerope V int2/token/g8\"")
add_test(NAME cli.calibration_layout_yields_to_flags
  COMMAND kvserve inspect --model ${MODELS}/stories260K.gguf --kv-calibration ${LAYOUT_CALIB} --kv-k-grouping token --json)
set_tests_properties(cli.calibration_layout_yields_to_flags PROPERTIES
  PASS_REGULAR_EXPRESSION "\"kv_dtype\":\"K int4/token/g8\\+prerope V int2/token/g8\"")
# A checkpoint whose weights are a type converted at load (synth writes
# Q4_K): it runs, and inspect names the conversion.
set(Q4K_MODEL ${CMAKE_BINARY_DIR}/cli_synth_q4_k.gguf)
add_test(NAME cli.synth_q4_k COMMAND kvserve synth --out ${Q4K_MODEL} --dim 256 --layers 1 --heads 4 --kv-heads 2
  --ffn 256 --vocab 64 --ctx 64 --weights q4_k)
set_tests_properties(cli.synth_q4_k PROPERTIES FIXTURES_SETUP q4k_model)
# Q4_K becomes Q4_1 where the build runs Q4_1 natively (the AVX2 interleaved
# kernel), Q8_0 elsewhere and always without interleaved copies.
add_test(NAME cli.inspect_names_converted_types COMMAND kvserve inspect --model ${Q4K_MODEL} --json)
set_tests_properties(cli.inspect_names_converted_types PROPERTIES FIXTURES_REQUIRED q4k_model
  PASS_REGULAR_EXPRESSION "\"converted_tensors\":9,\"converted_types\":\\{\"Q4_K\":\"Q(4_1|8_0)\"\\}")
add_test(NAME cli.inspect_converted_types_without_interleaving COMMAND kvserve inspect --model ${Q4K_MODEL} --json)
set_tests_properties(cli.inspect_converted_types_without_interleaving PROPERTIES FIXTURES_REQUIRED q4k_model
  ENVIRONMENT KVSERVE_INTERLEAVE_WEIGHTS=0
  PASS_REGULAR_EXPRESSION "\"converted_tensors\":9,\"converted_types\":\\{\"Q4_K\":\"Q8_0\"\\}")
add_test(NAME cli.generate_converted_q4_k COMMAND kvserve generate --model ${Q4K_MODEL} --prompt x --max-tokens 8
  --temperature 0)
set_tests_properties(cli.generate_converted_q4_k PROPERTIES FIXTURES_REQUIRED q4k_model)
# RoPE scaling: a Llama 3.1-style file (rope_freqs.weight) loads and runs;
# the llama.cpp flags stretch a model's context (inspect reports it); a
# context past the trained one with no scaling runs with a note.
set(LLAMA3_ROPE_MODEL ${CMAKE_BINARY_DIR}/cli_synth_llama3_rope.gguf)
add_test(NAME cli.synth_llama3_rope COMMAND kvserve synth --out ${LLAMA3_ROPE_MODEL} --dim 64 --layers 1 --heads 4
  --kv-heads 2 --ffn 128 --vocab 64 --ctx 256 --weights f32 --rope-scaling llama3 --rope-scale 8 --rope-orig-ctx 32)
set_tests_properties(cli.synth_llama3_rope PROPERTIES FIXTURES_SETUP llama3_rope_model)
add_test(NAME cli.inspect_rope_freq_factors COMMAND kvserve inspect --model ${LLAMA3_ROPE_MODEL} --json)
set_tests_properties(cli.inspect_rope_freq_factors PROPERTIES FIXTURES_REQUIRED llama3_rope_model
  PASS_REGULAR_EXPRESSION "\"rope_freq_factors\":8,\"rope_scaling\":\"freq factors \\(8\\)\"")
add_test(NAME cli.generate_rope_freq_factors COMMAND kvserve generate --model ${LLAMA3_ROPE_MODEL} --prompt x
  --max-tokens 200 --temperature 0)
set_tests_properties(cli.generate_rope_freq_factors PROPERTIES FIXTURES_REQUIRED llama3_rope_model)
add_test(NAME cli.inspect_rope_flags COMMAND kvserve inspect --model ${MODELS}/stories260K.gguf --ctx-size 2048
  --rope-scaling yarn --rope-scale 4 --json)
set_tests_properties(cli.inspect_rope_flags PROPERTIES PASS_REGULAR_EXPRESSION
  "\"context_length\":2048,.*\"rope_original_context\":512,\"rope_scaling\":\"yarn x4 \\(original context 512\\)\",.*\"trained_context_length\":512")
add_test(NAME cli.perplexity_past_trained_context COMMAND kvserve perplexity --model ${MODELS}/stories260K.gguf
  --file ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt --ctx 1024 --chunks 1 --ctx-size 1024 --json)
set_tests_properties(cli.perplexity_past_trained_context PROPERTIES
  PASS_REGULAR_EXPRESSION "past the model's context of 512 with no RoPE scaling given")
kvserve_error_test(cli.error_rope_scaling_name "--rope-scaling: longrope not in"
  inspect --model ${MODELS}/stories260K.gguf --rope-scaling longrope)
kvserve_error_test(cli.error_yarn_ext_factor "--yarn-ext-factor"
  inspect --model ${MODELS}/stories260K.gguf --yarn-ext-factor 2)
kvserve_error_test(cli.error_calibration_from_another_model "was measured on another model"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype int8
  --kv-calibration ${CMAKE_SOURCE_DIR}/tests/cli/other_model_calibration.json)
# Flags given that no layer would read are refused, not ignored; a preset's
# own settings are not flags (int4 then fp16: an FP16 cache without a window).
set(RANGES_CALIB ${CMAKE_SOURCE_DIR}/tests/cli/stories260K_ranges_calibration.json)
kvserve_error_test(cli.error_q4_0_group "--kv-group applies to int8, int4 and int2 with dynamic scales"
  inspect --model ${MODELS}/stories260K.gguf --kv-dtype q4_0 --kv-group 8)
kvserve_error_test(cli.error_float_grouping "--kv-grouping applies to int8, int4 and int2"
  inspect --model ${MODELS}/stories260K.gguf --kv-dtype fp16 --kv-grouping channel)
kvserve_error_test(cli.error_static_scale_bits "--kv-scale-bits applies to int8, int4 and int2 with dynamic scales"
  inspect --model ${MODELS}/stories260K.gguf --kv-calibration ${MIXED_CALIB} --kv-scale-bits 8)
kvserve_error_test(cli.error_outliers_on_float_layers "--kv-v-outliers: KV outliers apply to int8, int4 and int2"
  inspect --model ${MODELS}/stories260K.gguf --kv-dtype int4 --kv-v-outliers 1 --kv-layers 0-4:fp16)
kvserve_error_test(cli.error_residual_without_integer_layer "--kv-residual applies to integer KV types"
  inspect --model ${MODELS}/stories260K.gguf --kv-dtype fp16 --kv-residual 64)
kvserve_error_test(cli.error_calibration_unused "has no per-layer assignment and no layer uses its ranges"
  inspect --model ${MODELS}/stories260K.gguf --kv-dtype fp16 --kv-calibration ${RANGES_CALIB})
add_test(NAME cli.error_empty_preset COMMAND kvserve inspect --model ${MODELS}/stories260K.gguf --kv-preset "")
set_tests_properties(cli.error_empty_preset PROPERTIES PASS_REGULAR_EXPRESSION "--kv-preset: a KV preset .* must be named")
add_test(NAME cli.error_empty_kv_layers COMMAND kvserve inspect --model ${MODELS}/stories260K.gguf --kv-layers "")
set_tests_properties(cli.error_empty_kv_layers PROPERTIES PASS_REGULAR_EXPRESSION "--kv-layers: per-layer types .* must be named")
kvserve_error_test(cli.error_calibrate_reads_no_calibration "drop --kv-calibration"
  calibrate --model ${MODELS}/stories260K.gguf --data ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt
  --out calib_unused.json --ctx 64 --chunks 1 --kv-calibration ${RANGES_CALIB})
add_test(NAME cli.preset_then_float_type_has_no_window COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;perplexity;--model;${MODELS}/stories260K.gguf;--file;${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt;--ctx;64;--chunks;1;--kv-preset;int4;--kv-dtype;fp16;--json"
  "-DFIELDS=kv_dtype;kv_residual" "-DEQUALS=kv_dtype=fp16;kv_residual=0" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
# calibrate checks its output and layout before measuring; perplexity names
# the capacity flag that was given; inspect counts a full context in whole
# blocks (int2-small: 8 blocks of 8,160 bytes, 127.5 bytes per token).
kvserve_error_test(cli.error_calibrate_out_directory_missing "--out '/nonexistent_kvserve_dir/x.json': no such directory"
  calibrate --model ${MODELS}/stories260K.gguf --data ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt
  --out /nonexistent_kvserve_dir/x.json --ctx 64 --chunks 1)
kvserve_error_test(cli.error_calibrate_pre_rope_static_scales "pass --kv-scales dynamic"
  calibrate --model ${MODELS}/stories260K.gguf --data ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt
  --out calib_unused.json --ctx 64 --chunks 1 --kv-bits 3 --kv-preset int2)
kvserve_error_test(cli.error_ppl_kv_memory_too_small "raise --kv-memory"
  perplexity --model ${MODELS}/stories260K.gguf --file ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt
  --ctx 512 --chunks 1 --kv-preset int4 --kv-memory 300KiB)
add_test(NAME cli.inspect_full_context_in_whole_blocks COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;inspect;--model;${MODELS}/stories260K.gguf;--kv-preset;int2-small;--json"
  "-DFIELDS=kv_bytes_full_context" "-DEQUALS=kv_bytes_per_token=127;kv_bytes_full_context=65280"
  -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
# A byte budget too small for one request once FP16 staging is paid: refused
# at start, not a server that refuses every request.
kvserve_error_test(cli.error_serve_budget_below_one_request "cannot hold a request of 2 tokens"
  serve --model ${MODELS}/stories260K.gguf --port 0 --kv-preset int4-small --kv-memory 64KiB)
kvserve_error_test(cli.error_kv_outliers_negative "--kv-k-outliers"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-preset int2-small --kv-k-outliers -1)
kvserve_error_test(cli.error_kv_outliers_float "KV outliers apply to int8, int4 and int2"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-dtype fp16 --kv-v-outliers 1)
kvserve_error_test(cli.error_ppl_ctx "--ctx"
  perplexity --model ${MODELS}/stories260K.gguf --file ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt --ctx 4096)

# Perplexity on a few chunks must match the full run's protocol (exact value
# checked in perplexity_test); here: the JSON contract fields exist.
add_test(NAME cli.perplexity_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;perplexity;--model;${MODELS}/stories260K.gguf;--file;${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt;--ctx;128;--chunks;4;--json"
  "-DFIELDS=ppl;tokens;chunks;kv_bytes_per_token" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
add_test(NAME cli.bench_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--prompt-tokens;64;--gen-tokens;16;--bandwidth-mib;64;--json"
  "-DFIELDS=prefill_tok_s;decode_tok_s;decode_step_ms_median;kv_bytes_per_token;mem_bandwidth_gbs;bandwidth_fraction;kernels" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
# --compare-preset: a second preset decoded in the same run, steps alternating.
add_test(NAME cli.bench_compare_preset_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--kv-preset;int4-small;--compare-preset;fp16;--prompt-tokens;64;--gen-tokens;8;--bandwidth-mib;64;--json"
  "-DFIELDS=decode_tok_s;decode_speedup;decode_step_ms_median;compare_preset;compare_decode_tok_s;compare_decode_step_ms_median;compare_kv_dtype;compare_kv_bytes_per_token;compare_decode_bytes_per_token;bytes_bound_speedup"
  "-DABOVE=bytes_bound_speedup=1"
  -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
# The small presets' own 64-token blocks against FP16 in its own 16-token ones.
add_test(NAME cli.bench_compare_block_size_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--kv-preset;int4-small;--compare-preset;fp16;--compare-block-size;16;--prompt-tokens;64;--gen-tokens;4;--bandwidth-mib;16;--json"
  "-DFIELDS=decode_speedup;block_size;compare_block_size"
  "-DEQUALS=block_size=64;compare_block_size=16"
  -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
# The KV layout a preset and flags give (`bench --json`'s kv_dtype). A
# preset's keys given a float type drop its pre-RoPE spans, while a layer set
# back to int2 keeps them.
function(kvserve_kv_dtype_test name expected)
  add_test(NAME ${name} COMMAND ${CMAKE_COMMAND}
    "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;${ARGN};--prompt-tokens;32;--gen-tokens;2;--bandwidth-mib;16;--json"
    "-DFIELDS=kv_dtype" "-DEQUALS=kv_dtype=${expected}" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
endfunction()
kvserve_kv_dtype_test(cli.preset_float_keys_after_rope "K fp16 V int2/token/g8" --kv-preset int2 --kv-k fp16)
kvserve_kv_dtype_test(cli.preset_layer_back_to_int2_keeps_spans
  "0:K fp16 V int2/token/g8, 1:K int2/channel/g32+prerope16 V int2/token/g8, 2:K fp16 V int2/token/g8, 3:K fp16 V int2/token/g8, 4:K fp16 V int2/token/g8"
  --kv-preset int2 --kv-k fp16 --kv-layers 1:int2)
kvserve_kv_dtype_test(cli.preset_explicit_span_keeps_pre_rope "K fp16+prerope16 V int2/token/g8"
  --kv-preset int2 --kv-k fp16 --kv-k-rope-span 16)
# The final type decides, once: a layer set to fp16 and back to int2 keeps the
# preset's spans, and float layers keep pre-RoPE keys the flags asked for.
kvserve_kv_dtype_test(cli.layer_set_back_by_overlapping_entries_keeps_spans
  "K int2/channel/g32+prerope16 V int2/token/g8" --kv-preset int2 --kv-layers 1:fp16,1:int2)
kvserve_kv_dtype_test(cli.float_layer_keeps_explicit_pre_rope
  "0:K fp16+prerope V fp16, 1:K int4/token/g8+prerope V int4/token/g8, 2:K int4/token/g8+prerope V int4/token/g8, 3:K int4/token/g8+prerope V int4/token/g8, 4:K int4/token/g8+prerope V int4/token/g8"
  --kv-dtype int4 --kv-layers 0:fp16 --kv-k-pre-rope)
# vLLM's two FP8 KV names.
kvserve_kv_dtype_test(cli.kv_dtype_vllm_fp8_names "K fp8_e5m2 V fp8" --kv-k fp8_e5m2 --kv-v fp8_e4m3)
kvserve_error_test(cli.bench_error_compare_block_size_alone "--compare-block-size needs --compare-preset"
  bench --model ${MODELS}/stories260K.gguf --compare-block-size 16 --prompt-tokens 8 --gen-tokens 2 --bandwidth-mib 16)
kvserve_error_test(cli.bench_error_compare_preset_unknown "unknown --compare-preset 'nope'"
  bench --model ${MODELS}/stories260K.gguf --compare-preset nope --prompt-tokens 8 --gen-tokens 2 --bandwidth-mib 16)
kvserve_error_test(cli.bench_error_compare_preset_workload "decode benchmark only"
  bench --model ${MODELS}/stories260K.gguf --compare-preset fp16 --workload shared-prefix)
kvserve_error_test(cli.bench_error_compare_preset_attention "decode benchmark only"
  bench --attention-only --compare-preset fp16)
add_test(NAME cli.inspect_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;inspect;--model;${MODELS}/stories260K.bin;--tokenizer;${MODELS}/tok512.bin;--json"
  "-DFIELDS=dim;n_layers;n_kv_heads;head_dim;kv_bytes_per_token" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
# A vocabulary without add_bos_token (GPT-2's) gets no BOS from the CLI, as
# from the server (the CLI always prepended one).
kvserve_output_test(cli.tokenize_gpt2_vocab_adds_no_bos ${CMAKE_SOURCE_DIR}/tests/cli/gpt2_hello_world_tokens.txt
  tokenize --model ${KVSERVE_SHARED_DIR}/vocab/ggml-vocab-gpt-2.gguf --file ${CMAKE_SOURCE_DIR}/tests/cli/hello_world.txt)
# Characters spelled with byte-fallback tokens print whole (llama2.c's
# safe_printf dropped each byte, so "世界 é" vanished from the output).
kvserve_output_test(cli.generate_prints_byte_token_characters
  ${CMAKE_SOURCE_DIR}/tests/cli/stories260K_byte_tokens_12.txt
  generate --model ${MODELS}/stories260K.gguf --prompt "Hi 世界 é" --max-tokens 12 --temperature 0)
add_test(NAME cli.tokenize_vocab_only_gguf COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;tokenize;--model;${KVSERVE_SHARED_DIR}/vocab/ggml-vocab-llama-spm.gguf;--file;${MODELS}/README.md;--json"
  "-DFIELDS=tokens" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)

# The server (issue 6): clean start-up errors, the load generator's errors, and
# the whole server through the official OpenAI Node.js client (tests/server;
# its `openai` package is installed by scripts/install_deps.sh with npm ci).
kvserve_error_test(cli.serve_error_bad_host "cannot listen on 256.0.0.1:8080"
  serve --model ${MODELS}/stories260K.gguf --host 256.0.0.1)
kvserve_error_test(cli.serve_error_chat_template "unknown chat template 'jinja'"
  serve --model ${MODELS}/stories260K.gguf --port 0 --chat-template jinja)
kvserve_error_test(cli.serve_error_api_key_file "cannot open the API key file"
  serve --model ${MODELS}/stories260K.gguf --port 0 --api-keys ${MODELS}/no_such_keys.txt)
kvserve_error_test(cli.serve_error_require_key_without_keys "needs a key file"
  serve --model ${MODELS}/stories260K.gguf --port 0 --require-api-key)
kvserve_error_test(cli.bench_error_server_unreachable "cannot reach http://127.0.0.1:1"
  bench --server http://127.0.0.1:1 --requests 1)
kvserve_error_test(cli.bench_error_no_model "--model is required"
  bench --prompt-tokens 8)
# Shutdown signals on the real binary: a first SIGTERM/SIGINT drains and
# exits 0, a second one during the drain exits 1 with its message.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME cli.serve_shutdown_signals COMMAND ${Python3_EXECUTABLE} ${CMAKE_SOURCE_DIR}/tests/cli/serve_signals_test.py
           $<TARGET_FILE:kvserve> ${CMAKE_BINARY_DIR}/serve_signals)
  set_tests_properties(cli.serve_shutdown_signals PROPERTIES TIMEOUT 180)
else()
  message(WARNING "python3 not found: cli.serve_shutdown_signals is not registered")
endif()
find_program(KVSERVE_NODE node)
if(KVSERVE_NODE)
  add_test(NAME server.openai_node COMMAND ${KVSERVE_NODE} ${CMAKE_SOURCE_DIR}/tests/server/openai_client_test.mjs
           $<TARGET_FILE:kvserve> ${MODELS}/stories260K.gguf)
  set_tests_properties(server.openai_node PROPERTIES TIMEOUT 120)
else()
  message(WARNING "node not found: server.openai_node (the OpenAI client test) is not registered")
endif()

# Long-context attention benchmark (issue 4): a tiny synthetic run has the
# JSON contract; the capture writes a dump; missing inputs are clear errors.
add_test(NAME cli.bench_attention_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--attention-only;--workloads;synthetic;--keys;2048;--head-dims;16;--queries;2;--flush-mib;0;--topk-budgets;256;--hnsw-ef;32;--ivf-nprobe;4;--ivf-candidates;64;--ivf-nlist;16;--ivf-train-keys;1024;--compare-transforms;false;--json"
  "-DFIELDS=attention_bench;rows" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
add_test(NAME cli.bench_dump_qk_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--dump-qk;${CMAKE_BINARY_DIR}/cli_dump.qk;--file;${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt;--dump-max-tokens;512;--json"
  "-DFIELDS=dump_qk;tokens;chunk;head_dim" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
kvserve_error_test(cli.error_attention_without_dump "need --qk-file"
  bench --attention-only --workloads real --keys 1024)
kvserve_error_test(cli.error_attention_bad_list "not a positive integer"
  bench --attention-only --workloads synthetic --keys 16k)

# KV sparsity policies (issue 4): streaming perplexity and generation report
# the policy's fields; sinks generate past the context length; bad policy
# options are clear errors.
add_test(NAME cli.perplexity_streaming_policy_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;perplexity;--model;${MODELS}/stories260K.gguf;--file;${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt;--ctx;128;--chunks;2;--streaming;--kv-policy;h2o;--kv-budget;32;--json"
  "-DFIELDS=ppl;kv_tokens_kept_mean;kv_read_fraction;kv_policy;kv_tokens_evicted" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
add_test(NAME cli.generate_sinks_past_context_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;generate;--model;${MODELS}/stories260K.gguf;--prompt;${ONCE};--max-tokens;1200;--temperature;0;--kv-policy;sinks;--kv-budget;64;--kv-blocks;8;--json"
  "-DFIELDS=kv_bytes_used_history;kv_bytes_used_peak;kv_tokens_kept_mean;kv_tokens_evicted" -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
kvserve_error_test(cli.error_policy_without_streaming "--streaming"
  perplexity --model ${MODELS}/stories260K.gguf --file ${KVSERVE_SHARED_DIR}/data/tinystories_train_head.txt --ctx 128 --chunks 1 --kv-policy window --kv-budget 16)
kvserve_error_test(cli.error_policy_unknown "unknown --kv-policy"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 8 --kv-policy lru --kv-budget 8)
kvserve_error_test(cli.error_policy_past_context "only positions within the cache"
  generate --model ${MODELS}/stories260K.gguf --prompt x --max-tokens 1000 --kv-policy window --kv-budget 8)

# Serving workloads through the engine (issues 5-7): the JSON contract of each.
add_test(NAME cli.bench_workload_shared_prefix_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--workload;shared-prefix;--requests;6;--tenants;2;--same-prompt;true;--prefix-tokens;64;--suffix-tokens;4;--max-tokens;2;--concurrency;2;--threads;1;--json"
  "-DFIELDS=prefill_tokens_computed;ttft_p50_ms;ttft_p99_ms;kv_bytes_peak;prefix_hit_rate;max_running;cross_tenant_cached_tokens;within_tenant_hit_rate"
  -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
add_test(NAME cli.bench_workload_returning_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--workload;returning;--requests;6;--turns;2;--prefix-tokens;64;--suffix-tokens;4;--max-tokens;2;--concurrency;2;--threads;1;--kv-tiers;host:16MiB;--json"
  "-DFIELDS=returning_hit_rate;tier_blocks_loaded;prefix_hit_rate"
  -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
add_test(NAME cli.bench_workload_hot_burst_json COMMAND ${CMAKE_COMMAND}
  "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--workload;hot-burst;--requests;20;--prefix-tokens;64;--suffix-tokens;4;--max-tokens;2;--concurrency;2;--threads;1;--json"
  "-DFIELDS=hot_hit_rate;prefix_blocks_pinned"
  -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
kvserve_error_test(cli.error_workload_unknown "unknown workload"
  bench --model ${MODELS}/stories260K.gguf --workload nope)
# --replicas: three real serve processes sharing a redis-server started for the run.
find_program(KVSERVE_REDIS_SERVER redis-server)
if(KVSERVE_REDIS_SERVER)
  add_test(NAME cli.bench_replicas_json COMMAND ${CMAKE_COMMAND}
    "-DCOMMAND=$<TARGET_FILE:kvserve>;bench;--model;${MODELS}/stories260K.gguf;--workload;shared-prefix;--replicas;3;--requests;5;--prefix-tokens;128;--suffix-tokens;8;--max-tokens;2;--threads;1;--kv-dtype;fp16;--json"
    "-DFIELDS=compute_ttft_ms;load_ttft_ms;ttft_speedup;replica_hit_rate;tier_blocks_loaded;failed;per_replica"
    -P ${CMAKE_SOURCE_DIR}/tests/cli/expect_json_fields.cmake)
else()
  message(WARNING "redis-server not found: cli.bench_replicas_json is not registered")
endif()
kvserve_error_test(cli.error_replicas_one "at least 2"
  bench --model ${MODELS}/stories260K.gguf --workload shared-prefix --replicas 1)
kvserve_error_test(cli.error_replicas_tiers_without_redis "must name a redis"
  bench --model ${MODELS}/stories260K.gguf --workload shared-prefix --replicas 2 --kv-tiers host:1MiB)
