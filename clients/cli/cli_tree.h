// deft-cli tree: a server-side tree job (RunTree) from command-line options.
#pragma once

#include <string>
#include <vector>

#include "deft/v1/deft.grpc.pb.h"

namespace deft::cli {

// Runs `deft-cli tree ARGS`; returns the process exit code.
int tree_command(deft::v1::Deft::Stub& stub, const std::vector<std::string>& args);

}  // namespace deft::cli
