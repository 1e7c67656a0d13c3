// Where the embedded default model (models/default in the source tree) is found at run time,
// for deft-server and deft-tree when no --model is given: $DEFT_DEFAULT_MODEL, then an
// installed copy relative to the executable (<prefix>/bin/.. /share/deft/models/default, as
// `cmake --install` lays it out, so a moved prefix still finds its own), then the source tree
// the binary was built from, then models/default under the working directory.
#pragma once

#include <filesystem>

namespace deft::models {

// The first candidate holding a config.json; the installed location when none does (so the
// error that follows names where it was looked for).
std::filesystem::path default_model_dir();

}  // namespace deft::models
