#include "server/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/log_format.h"
#include "spdlog/spdlog.h"

namespace deft::server {
namespace {

constexpr std::chrono::minutes kRefusalLogInterval{1};
// Refusal log times of this many peers at most: a scan of many addresses cannot grow memory.
constexpr size_t kMaxRefusalPeers = 4096;

bool valid_id(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (const char c : id) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') {
      return false;
    }
  }
  return true;
}

// "ipv4:10.1.2.3:5678" -> "ipv4:10.1.2.3": a client opens many connections from one address.
std::string peer_address(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  const size_t first = peer.find(':');
  if (colon == std::string::npos || colon == first) return peer;
  return peer.substr(0, colon);
}

}  // namespace

KeyDigest sha256(absl::string_view text) {
  KeyDigest digest;
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

absl::StatusOr<ApiKeys> ApiKeys::parse(const std::string& text, const std::string& source) {
  ApiKeys keys;
  std::set<std::string> ids;
  std::set<KeyDigest> digests;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line.front() == '#') continue;
    const auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(source, " line ", line_number, ": ", what));
    };
    std::string id;
    absl::string_view key = line;
    if (const size_t colon = line.find(':'); colon != absl::string_view::npos) {
      id = std::string(line.substr(0, colon));
      key = line.substr(colon + 1);
      if (!valid_id(id)) {
        return bad(absl::StrCat("key id '", absl::CHexEscape(id),
                                "' must be 1 to 64 characters of A-Z a-z 0-9 _ . -"));
      }
    }
    for (const char c : key) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c))) {
        return bad("a key must not contain whitespace");
      }
    }
    if (key.size() < kMinKeyBytes) {
      return bad(absl::StrCat("the key has ", key.size(), " characters; at least ", kMinKeyBytes,
                              " are required (e.g. openssl rand -hex 32)"));
    }
    const KeyDigest digest = sha256(key);
    if (id.empty()) {
      id = absl::BytesToHexString(
          absl::string_view(reinterpret_cast<const char*>(digest.data()), 4));
    }
    if (!ids.insert(id).second) return bad(absl::StrCat("key id '", id, "' is used twice"));
    if (!digests.insert(digest).second) return bad("the same key is listed twice");
    keys.keys_.push_back({.id = std::move(id), .digest = digest});
  }
  if (keys.keys_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no keys (every call would be refused)"));
  }
  return keys;
}

absl::StatusOr<ApiKeys> ApiKeys::load(const std::string& path) {
  std::ifstream file(path);
  if (!file) {
    return absl::NotFoundError(
        absl::StrCat("api_keys: cannot read ", path, ": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << file.rdbuf();
  if (file.bad()) return absl::NotFoundError(absl::StrCat("api_keys: cannot read ", path));
  return parse(text.str(), absl::StrCat("api_keys ", path));
}

std::optional<std::string> ApiKeys::find(absl::string_view key) const {
  const KeyDigest digest = sha256(key);
  const ApiKey* match = nullptr;
  // Every digest is compared, whatever matched before: the time does not depend on the key.
  for (const ApiKey& candidate : keys_) {
    const bool equal = CRYPTO_memcmp(candidate.digest.data(), digest.data(), digest.size()) == 0;
    if (equal) match = &candidate;
  }
  if (match == nullptr) return std::nullopt;
  return match->id;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::from_file(const std::string& path) {
  absl::StatusOr<ApiKeys> keys = ApiKeys::load(path);
  if (!keys.ok()) return keys.status();
  auto authenticator = std::make_unique<Authenticator>();
  authenticator->path_ = path;
  authenticator->keys_ = std::make_shared<const ApiKeys>(std::move(*keys));
  return authenticator;
}

absl::StatusOr<size_t> Authenticator::reload() {
  if (path_.empty()) return 0;
  absl::StatusOr<ApiKeys> keys = ApiKeys::load(path_);
  if (!keys.ok()) return keys.status();
  const size_t count = keys->size();
  std::lock_guard lock(mutex_);
  keys_ = std::make_shared<const ApiKeys>(std::move(*keys));
  return count;
}

absl::StatusOr<Caller> Authenticator::authenticate(const grpc::ServerContext& context) const {
  if (path_.empty()) return Caller{};
  const auto& metadata = context.client_metadata();
  const auto found = metadata.find("authorization");
  if (found == metadata.end()) return authenticate(std::nullopt, context.peer());
  return authenticate(absl::string_view(found->second.data(), found->second.size()),
                      context.peer());
}

absl::StatusOr<Caller> Authenticator::authenticate(std::optional<absl::string_view> authorization,
                                                   const std::string& peer) const {
  if (path_.empty()) return Caller{};
  const auto refuse = [&](const std::string& reason, const std::string& message) {
    log_refusal(peer, reason);
    return absl::UnauthenticatedError(message);
  };
  if (!authorization) {
    return refuse("no authorization metadata",
                  "this server requires an API key: send the metadata 'authorization: Bearer "
                  "KEY'");
  }
  const absl::string_view value = *authorization;
  constexpr absl::string_view kScheme = "Bearer ";
  if (!absl::StartsWithIgnoreCase(value, kScheme)) {
    return refuse("authorization is not a Bearer token",
                  "the authorization metadata must be 'Bearer KEY'");
  }
  const absl::string_view key = absl::StripAsciiWhitespace(value.substr(kScheme.size()));
  std::shared_ptr<const ApiKeys> keys;
  {
    std::lock_guard lock(mutex_);
    keys = keys_;
  }
  std::optional<std::string> id = keys->find(key);
  if (!id) return refuse("unknown API key", "the API key is not valid");
  return Caller{.key_id = std::move(*id)};
}

void Authenticator::log_refusal(const std::string& peer, const std::string& reason) const {
  const std::string address = peer_address(peer);
  const auto now = std::chrono::steady_clock::now();
  int64_t unlogged = 0;
  {
    std::lock_guard lock(mutex_);
    auto [it, inserted] = last_refusal_logged_.try_emplace(address, RefusalLog{.logged = now});
    if (!inserted) {
      if (now - it->second.logged < kRefusalLogInterval) {
        ++it->second.unlogged;
        return;
      }
      unlogged = it->second.unlogged;
      it->second = RefusalLog{.logged = now};
    }
    if (last_refusal_logged_.size() > kMaxRefusalPeers) {
      std::erase_if(last_refusal_logged_, [&](const auto& entry) {
        return now - entry.second.logged >= kRefusalLogInterval;
      });
      // Still full of recent peers (a scan): forget them rather than grow.
      if (last_refusal_logged_.size() > kMaxRefusalPeers) last_refusal_logged_.clear();
    }
  }
  log_fields(spdlog::level::warn,
             absl::StrCat("auth: refused a call from ", address, ": ", reason,
                          " (logged once a minute per peer)"),
             {{"peer", address}, {"reason", reason}, {"unlogged_since_last", unlogged}});
}

}  // namespace deft::server
