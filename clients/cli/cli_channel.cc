#include "clients/cli/cli_channel.h"

#include <grpcpp/support/client_interceptor.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace deft::cli {
namespace {

bool read_file(const std::string& option, const std::string& path, std::string* text,
               std::string* error) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    *error = absl::StrCat(option, ": cannot read ", path, ": ", std::strerror(errno));
    return false;
  }
  std::stringstream content;
  content << file.rdbuf();
  *text = content.str();
  return true;
}

// Adds `authorization: Bearer KEY` to every call's initial metadata (plaintext or TLS alike;
// gRPC's call credentials would refuse a plaintext channel).
class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string& value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", value_});
    }
    methods->Proceed();
  }

 private:
  const std::string value_;
};

class BearerInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::string key) : value_("Bearer " + std::move(key)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(value_);  // gRPC owns interceptors it is given
  }

 private:
  const std::string value_;
};

}  // namespace

ChannelFlag parse_channel_flag(const std::vector<std::string>& args, size_t* index,
                               ChannelOptions* options) {
  const std::string& flag = args[*index];
  if (flag == "--tls") {
    options->tls = true;
    return ChannelFlag::kParsed;
  }
  std::string* target = nullptr;
  if (flag == "--server") target = &options->server;
  if (flag == "--tls-ca") target = &options->tls_ca;
  if (flag == "--tls-cert") target = &options->tls_cert;
  if (flag == "--tls-key") target = &options->tls_key;
  if (flag == "--api-key") target = &options->api_key;
  if (target == nullptr) return ChannelFlag::kNotChannel;
  if (*index + 1 >= args.size()) return ChannelFlag::kMissingValue;
  *target = args[++*index];
  if (flag.rfind("--tls-", 0) == 0) options->tls = true;
  return ChannelFlag::kParsed;
}

std::shared_ptr<grpc::Channel> make_channel(const ChannelOptions& options, std::string* error) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    if (options.tls_cert.empty() != options.tls_key.empty()) {
      *error = "--tls-cert and --tls-key go together (a client certificate and its key)";
      return nullptr;
    }
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca.empty() &&
        !read_file("--tls-ca", options.tls_ca, &ssl.pem_root_certs, error)) {
      return nullptr;
    }
    if (!options.tls_cert.empty() &&
        (!read_file("--tls-cert", options.tls_cert, &ssl.pem_cert_chain, error) ||
         !read_file("--tls-key", options.tls_key, &ssl.pem_private_key, error))) {
      return nullptr;
    }
    credentials = grpc::SslCredentials(ssl);
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.api_key.empty()) {
    interceptors.push_back(std::make_unique<BearerInterceptorFactory>(options.api_key));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      options.server, credentials, grpc::ChannelArguments(), std::move(interceptors));
}

}  // namespace deft::cli
