// API keys: who may call the server. Keys come from a file (--api-keys FILE), one a line:
//
//   # comments and blank lines are ignored; spaces around a line are trimmed
//   alice:3f1c9a...        ID:KEY  the key id `alice` names the key in logs and metrics
//   8d2e07...              KEY     its id is the first 8 hex digits of SHA-256(KEY)
//
// A key has at least kMinKeyBytes characters and no whitespace; ids are [A-Za-z0-9_.-] and
// unique. Only SHA-256 digests of the keys are kept in memory; a presented key is hashed and
// compared with every stored digest in constant time (CRYPTO_memcmp, no early exit), so neither
// the keys nor their position leak through timing. Clients send `authorization: Bearer KEY`.
#pragma once

#include <grpcpp/grpcpp.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deft::server {

// Shorter keys are refused at load: a key is a secret, not a password to remember.
inline constexpr size_t kMinKeyBytes = 16;

using KeyDigest = std::array<uint8_t, 32>;

// SHA-256 of `text`.
KeyDigest sha256(absl::string_view text);

// One loaded key: its id and the digest of the key.
struct ApiKey {
  std::string id;
  KeyDigest digest;
};

// An immutable set of keys, parsed from a key file's text.
class ApiKeys {
 public:
  // INVALID_ARGUMENT names `source`, the line number and what is wrong with it (never the key).
  static absl::StatusOr<ApiKeys> parse(const std::string& text, const std::string& source);
  // Reads and parses `path`; NOT_FOUND / INVALID_ARGUMENT name the path.
  static absl::StatusOr<ApiKeys> load(const std::string& path);

  // The id of `key` when it is one of the keys, in time independent of which one matches.
  std::optional<std::string> find(absl::string_view key) const;
  size_t size() const { return keys_.size(); }

 private:
  std::vector<ApiKey> keys_;
};

// What the server knows about a caller once authenticated.
struct Caller {
  std::string key_id;  // empty when the server runs without keys
};

// The server's keys, reloadable while it serves. With no key file every call is accepted
// (key id ""), which is the behaviour of a loopback-only server.
class Authenticator {
 public:
  // No keys: every call is accepted.
  Authenticator() = default;
  // Loads `path`; the error names it.
  static absl::StatusOr<std::unique_ptr<Authenticator>> from_file(const std::string& path);

  bool enabled() const { return !path_.empty(); }
  // Re-reads the key file (SIGHUP). On error the keys in use stay as they were. Returns the
  // number of keys loaded.
  absl::StatusOr<size_t> reload();

  // The caller of a call: UNAUTHENTICATED when keys are required and the call carries no
  // `authorization: Bearer KEY` metadata or an unknown key. A refusal is logged at most once
  // per peer address a minute, with the peer, the reason and how many refusals of that peer
  // went unlogged since its last line, never the key (a scan or a misconfigured client cannot
  // flood the log).
  absl::StatusOr<Caller> authenticate(const grpc::ServerContext& context) const;
  // The same for any transport (the HTTP API): `authorization` is the header's value (nullopt
  // when absent), `peer` the client's address as gRPC writes it ("ipv4:10.1.2.3:5678").
  absl::StatusOr<Caller> authenticate(std::optional<absl::string_view> authorization,
                                      const std::string& peer) const;

 private:
  std::string path_;
  mutable std::mutex mutex_;  // guards keys_ (swapped whole by reload) and last_refusal_logged_
  std::shared_ptr<const ApiKeys> keys_;
  // Per peer address: when its last refusal was logged, and the refusals since (not logged).
  struct RefusalLog {
    std::chrono::steady_clock::time_point logged;
    int64_t unlogged = 0;
  };
  mutable std::map<std::string, RefusalLog> last_refusal_logged_;

  void log_refusal(const std::string& peer, const std::string& reason) const;
};

}  // namespace deft::server
