// deft-cli's connection: the server address, plaintext or TLS (--tls-ca, client certificate for
// mutual TLS), and the API key sent as `authorization: Bearer KEY` on every call.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

namespace deft::cli {

struct ChannelOptions {
  std::string server = "127.0.0.1:50051";
  bool tls = false;      // --tls, or implied by any --tls-* file
  std::string tls_ca;    // PEM CAs to trust; empty: the system's roots
  std::string tls_cert;  // PEM client certificate (mutual TLS)
  std::string tls_key;   // its PEM private key
  std::string api_key;   // --api-key, else $DEFT_API_KEY; empty: none sent
};

// Consumes the connection option at args[*index] (and its value), moving *index to its last
// argument. kNotChannel: args[*index] is some other argument.
enum class ChannelFlag { kParsed, kNotChannel, kMissingValue };
ChannelFlag parse_channel_flag(const std::vector<std::string>& args, size_t* index,
                               ChannelOptions* options);

// The channel, or null with `error` naming the file that cannot be read.
std::shared_ptr<grpc::Channel> make_channel(const ChannelOptions& options, std::string* error);

}  // namespace deft::cli
