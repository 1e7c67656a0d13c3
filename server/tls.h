// Transport credentials of the gRPC port: plaintext, TLS (--tls-cert, --tls-key) or mutual TLS
// (--tls-client-ca as well: a client must present a certificate signed by one of those CAs,
// else the handshake fails). gRPC's own SslServerCredentials do the TLS; this file only reads
// and checks the PEM files first, so a missing, unreadable or invalid file fails the start
// with a message that names it (gRPC would only fail BuildAndStart without saying why).
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace deft::server {

struct TlsFiles {
  std::string cert;       // PEM certificate chain of the server; empty: plaintext
  std::string key;        // PEM private key of `cert`
  std::string client_ca;  // PEM CA bundle for client certificates; empty: no client certs
};

// Plaintext when `files` is empty. INVALID_ARGUMENT names the option and the path: a file that
// cannot be read, holds no PEM certificate / private key, a key that does not match the
// certificate, or a half-given pair.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsFiles& files);

// "plaintext", "TLS" or "mutual TLS", for the startup log.
std::string describe_transport(const TlsFiles& files);

}  // namespace deft::server
