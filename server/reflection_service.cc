#include "server/reflection_service.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <set>

#include "absl/strings/str_cat.h"

namespace deft::server {
namespace {

namespace reflection = grpc::reflection::v1alpha;
using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;

// `file` and, depth first, the files it imports that `sent` does not hold yet.
void add_file(const FileDescriptor* file, std::set<std::string>& sent,
              reflection::FileDescriptorResponse* out) {
  if (!sent.insert(file->name()).second) return;
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) add_file(file->dependency(i), sent, out);
}

void set_error(reflection::ServerReflectionResponse& response, grpc::StatusCode code,
               const std::string& message) {
  response.mutable_error_response()->set_error_code(static_cast<int32_t>(code));
  response.mutable_error_response()->set_error_message(message);
}

}  // namespace

ReflectionService::ReflectionService(const Authenticator& auth, bool require_key,
                                     std::vector<std::string> services)
    : auth_(auth), require_key_(require_key), services_(std::move(services)) {}

grpc::Status ReflectionService::ServerReflectionInfo(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<reflection::ServerReflectionResponse,
                             reflection::ServerReflectionRequest>* stream) {
  if (require_key_) {
    if (absl::StatusOr<Caller> caller = auth_.authenticate(*context); !caller.ok()) {
      return grpc::Status(static_cast<grpc::StatusCode>(caller.status().code()),
                          std::string(caller.status().message()));
    }
  }
  const DescriptorPool& pool = *DescriptorPool::generated_pool();
  std::set<std::string> sent;  // files this stream has sent (the protocol lets us skip them)
  reflection::ServerReflectionRequest request;
  while (stream->Read(&request)) {
    reflection::ServerReflectionResponse response;
    response.set_valid_host(request.host());
    *response.mutable_original_request() = request;
    const auto send_file = [&](const FileDescriptor* file, const std::string& what) {
      if (file == nullptr) {
        set_error(response, grpc::StatusCode::NOT_FOUND, absl::StrCat(what, " not found"));
      } else {
        add_file(file, sent, response.mutable_file_descriptor_response());
      }
    };
    switch (request.message_request_case()) {
      case reflection::ServerReflectionRequest::kListServices:
        for (const std::string& name : services_) {
          response.mutable_list_services_response()->add_service()->set_name(name);
        }
        break;
      case reflection::ServerReflectionRequest::kFileByFilename:
        send_file(pool.FindFileByName(request.file_by_filename()),
                  absl::StrCat("file '", request.file_by_filename(), "'"));
        break;
      case reflection::ServerReflectionRequest::kFileContainingSymbol:
        send_file(pool.FindFileContainingSymbol(request.file_containing_symbol()),
                  absl::StrCat("symbol '", request.file_containing_symbol(), "'"));
        break;
      case reflection::ServerReflectionRequest::kFileContainingExtension: {
        const reflection::ExtensionRequest& extension = request.file_containing_extension();
        const google::protobuf::Descriptor* type =
            pool.FindMessageTypeByName(extension.containing_type());
        const google::protobuf::FieldDescriptor* field =
            type == nullptr ? nullptr
                            : pool.FindExtensionByNumber(type, extension.extension_number());
        send_file(field == nullptr ? nullptr : field->file(),
                  absl::StrCat("extension ", extension.extension_number(), " of '",
                               extension.containing_type(), "'"));
        break;
      }
      case reflection::ServerReflectionRequest::kAllExtensionNumbersOfType: {
        const google::protobuf::Descriptor* type =
            pool.FindMessageTypeByName(request.all_extension_numbers_of_type());
        if (type == nullptr) {
          set_error(response, grpc::StatusCode::NOT_FOUND,
                    absl::StrCat("type '", request.all_extension_numbers_of_type(), "' not found"));
          break;
        }
        std::vector<const google::protobuf::FieldDescriptor*> extensions;
        pool.FindAllExtensions(type, &extensions);
        reflection::ExtensionNumberResponse* numbers =
            response.mutable_all_extension_numbers_response();
        numbers->set_base_type_name(type->full_name());
        for (const auto* field : extensions) numbers->add_extension_number(field->number());
        break;
      }
      case reflection::ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
        set_error(response, grpc::StatusCode::INVALID_ARGUMENT,
                  "the request sets none of list_services, file_by_filename, "
                  "file_containing_symbol, file_containing_extension, "
                  "all_extension_numbers_of_type");
        break;
    }
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

}  // namespace deft::server
