#include "server/tls.h"

#include <grpcpp/security/server_credentials.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace deft::server {
namespace {

absl::StatusOr<std::string> read_pem(const char* option, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << file.rdbuf();
  if (file.bad()) return absl::InvalidArgumentError(absl::StrCat(option, ": cannot read ", path));
  return text.str();
}

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Deleter {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyDeleter>;

BioPtr memory_bio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM text; null when there is none.
X509Ptr first_certificate(const std::string& pem) {
  BioPtr bio = memory_bio(pem);
  return X509Ptr(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsFiles& files) {
  if (files.cert.empty() && files.key.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs TLS: give --tls-cert and --tls-key as well");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS needs both --tls-cert and --tls-key; only ",
        files.cert.empty() ? "--tls-key " + files.key : "--tls-cert " + files.cert, " is given"));
  }
  absl::StatusOr<std::string> cert = read_pem("--tls-cert", files.cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = read_pem("--tls-key", files.key);
  if (!key.ok()) return key.status();

  X509Ptr certificate = first_certificate(*cert);
  if (certificate == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: ", files.cert, " holds no PEM certificate"));
  }
  KeyPtr private_key;
  {
    BioPtr bio = memory_bio(*key);
    private_key.reset(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  }
  if (private_key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key: ", files.key, " holds no PEM private key (or one protected by a passphrase)"));
  }
  if (X509_check_private_key(certificate.get(), private_key.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-key: the key in ", files.key,
                                                   " does not belong to the certificate in ",
                                                   files.cert));
  }

  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({.private_key = *key, .cert_chain = *cert});
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::string> ca = read_pem("--tls-client-ca", files.client_ca);
    if (!ca.ok()) return ca.status();
    if (first_certificate(*ca) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-client-ca: ", files.client_ca, " holds no PEM certificate"));
    }
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

std::string describe_transport(const TlsFiles& files) {
  if (files.cert.empty()) return "plaintext";
  return files.client_ca.empty() ? "TLS" : "mutual TLS";
}

}  // namespace deft::server
