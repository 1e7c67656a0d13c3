// deft-cli verify: a drafted token tree verified under a session node (the TreeSession stream's
// verify command, which reaches the session's replica behind a load balancer).
#pragma once

#include <string>
#include <vector>

#include "clients/cli/cli_common.h"
#include "deft/v1/deft.grpc.pb.h"

namespace deft::cli {

// Parses --tokens, --parents, --draft-probs, --draft-dist, --draft-sampling and SAMPLING from
// args[start...] into `command`;
// other arguments go to `positional` (an error when it is null). Empty string, or the error.
std::string parse_verify_args(const std::vector<std::string>& args, size_t start,
                              deft::v1::VerifyCommand* command, PromptArgs* positional);

// Prints a verify's answer: "accepted ... (entries ...)", "bonus ...", "node ...".
void print_verified(const deft::v1::VerifyResponse& verified);

// Runs `deft-cli verify ARGS`; returns the process exit code.
int verify_command(deft::v1::Deft::Stub& stub, const std::vector<std::string>& args);

}  // namespace deft::cli
