// kvserve: one binary, one subcommand per job.
#include <cstdio>
#include <exception>

#include "tools/cli_common.h"
#include "util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"kvserve: an LLM inference engine built around an optimized KV cache"};
  app.require_subcommand(1);
  kvserve::cli::register_generate(app);
  kvserve::cli::register_perplexity(app);
  kvserve::cli::register_bench(app);
  kvserve::cli::register_inspect(app);
  kvserve::cli::register_tokenize(app);
  kvserve::cli::register_synth(app);
  kvserve::cli::register_calibrate(app);
  kvserve::cli::register_serve(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and the like print and succeed; bad arguments are errors like
    // any other: one line, status 1.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "kvserve: error: %s (see --help)\n", e.what());
    return 1;
  } catch (const kvserve::Error& e) {
    std::fprintf(stderr, "kvserve: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kvserve: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvserve: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
