#!/usr/bin/env bash
# The main job on the bundled model: generate a story with the default KV
# configuration; the KV memory it used is printed on stderr at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
build/kvserve generate --model models/stories260K.gguf --prompt "Once upon a time" --max-tokens 256 --temperature 0
