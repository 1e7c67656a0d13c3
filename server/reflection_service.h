// Server reflection (grpc.reflection.v1alpha.ServerReflection, what grpcurl and grpc_cli ask):
// the services this server offers and the .proto files that describe them, from the
// descriptors compiled into the binary. Our own rather than gRPC's reflection plugin so that it
// can require an API key (auth_reflection): a gRPC server interceptor cannot refuse a call.
// Open by default, as Triton and llama.cpp leave their discovery endpoints: it describes only
// the public API of proto/, which is published anyway.
#pragma once

#include <string>
#include <vector>

#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/auth.h"

namespace deft::server {

class ReflectionService final : public grpc::reflection::v1alpha::ServerReflection::Service {
 public:
  // `services`: the full names list_services answers. With `require_key`, callers authenticate
  // through `auth`, which must outlive the service.
  ReflectionService(const Authenticator& auth, bool require_key, std::vector<std::string> services);

  // Answers each request of the stream in order: list_services, file_by_filename,
  // file_containing_symbol, file_containing_extension, all_extension_numbers_of_type; an
  // unknown name gets an error_response NOT_FOUND and the stream goes on.
  grpc::Status ServerReflectionInfo(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<grpc::reflection::v1alpha::ServerReflectionResponse,
                               grpc::reflection::v1alpha::ServerReflectionRequest>* stream)
      override;

 private:
  const Authenticator& auth_;
  const bool require_key_;
  const std::vector<std::string> services_;
};

}  // namespace deft::server
