// deft-cli verify: a drafted token tree verified under a session node (Verify).
#pragma once

#include <string>
#include <vector>

#include "clients/cli/cli_common.h"
#include "deft/v1/deft.grpc.pb.h"

namespace deft::cli {

// Parses --tokens, --parents, --draft-probs and SAMPLING from args[start...] into `request`;
// other arguments go to `positional` (an error when it is null). Empty string, or the error.
std::string parse_verify_args(const std::vector<std::string>& args, size_t start,
                              deft::v1::VerifyRequest* request, PromptArgs* positional);

// Calls Verify and prints the answer ("accepted ...", "bonus ...", "node ..."); 0 (the answer
// in `answer` when given), or 1 on an error status.
int call_verify(deft::v1::Deft::Stub& stub, const deft::v1::VerifyRequest& request,
                deft::v1::VerifyResponse* answer = nullptr);

// Runs `deft-cli verify ARGS`; returns the process exit code.
int verify_command(deft::v1::Deft::Stub& stub, const std::vector<std::string>& args);

}  // namespace deft::cli
