#include "server/deft_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "engine/sampler.h"
#include "server/metrics.h"
#include "spdlog/spdlog.h"

namespace deft::server {
namespace {

namespace v1 = deft::v1;

grpc::Status to_grpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share the google.rpc.Code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

grpc::Status invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

const char* code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

v1::FinishReason to_proto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

grpc::Status unimplemented(const char* rpc) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      absl::StrCat(rpc,
                                   " is not implemented by this server yet (it needs the "
                                   "engine Scheduler of issue 6); Generate, Tokenize, "
                                   "Detokenize and ModelInfo are"));
}

// How often a streaming handler looks at its client while waiting for the engine.
constexpr std::chrono::milliseconds kPollInterval{50};

}  // namespace

DeftService::DeftService(const ServerConfig& config, ModelFacts model,
                         const engine::Tokenizer& tokenizer, EngineThread& engine,
                         ServerMetrics* metrics)
    : config_(config),
      model_(std::move(model)),
      tokenizer_(tokenizer),
      engine_(engine),
      metrics_(metrics) {}

grpc::Status DeftService::done(const char* rpc, grpc::Status status) const {
  if (metrics_ != nullptr) metrics_->record_request(rpc, code_name(status.error_code()));
  if (!status.ok()) {
    spdlog::debug("{}: {} {}", rpc, code_name(status.error_code()), status.error_message());
  }
  return status;
}

absl::StatusOr<std::vector<engine::TokenId>> DeftService::prompt_tokens(
    const v1::Prompt& prompt, const std::string& field) const {
  std::vector<engine::TokenId> ids;
  switch (prompt.kind_case()) {
    case v1::Prompt::kText: {
      if (prompt.text().size() > static_cast<size_t>(config_.max_text_bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".text has ", prompt.text().size(),
                                                       " bytes; the limit is ",
                                                       config_.max_text_bytes));
      }
      // Client text is untrusted: special-token strings in it stay text.
      absl::StatusOr<std::vector<engine::TokenId>> encoded =
          tokenizer_.encode(prompt.text(), /*add_bos=*/true, /*parse_special=*/false);
      if (!encoded.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".text: ", encoded.status().message()));
      }
      ids = std::move(*encoded);
      break;
    }
    case v1::Prompt::kTokens: {
      const auto& given = prompt.tokens().ids();
      for (int i = 0; i < given.size(); ++i) {
        if (given[i] < 0 || given[i] >= model_.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat(field, ".tokens.ids[", i, "] = ", given[i],
                                                         " is outside the vocabulary [0, ",
                                                         model_.vocab_size, ")"));
        }
      }
      ids.assign(given.begin(), given.end());
      break;
    }
    case v1::Prompt::KIND_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is empty: set ", field, ".text or ", field, ".tokens"));
  }
  if (ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has no tokens"));
  }
  if (static_cast<int64_t>(ids.size()) > config_.max_prompt_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", ids.size(), " tokens; the limit is ",
                     config_.max_prompt_tokens, " (max_prompt_tokens)"));
  }
  return ids;
}

// ---- Generate -----------------------------------------------------------------------------

grpc::Status DeftService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  return done("Generate", generate(context, *request, writer));
}

grpc::Status DeftService::generate(grpc::ServerContext* context, const v1::GenerateRequest& request,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  GenerateJobRequest job;
  absl::StatusOr<std::vector<engine::TokenId>> prompt = prompt_tokens(request.prompt(), "prompt");
  if (!prompt.ok()) return to_grpc(prompt.status());
  job.prompt = std::move(*prompt);

  if (request.n() < 0 || request.n() > config_.max_branches) {
    return invalid(absl::StrCat("n = ", request.n(), " must be in [1, ", config_.max_branches,
                                "] (0 means 1; max_branches)"));
  }
  job.n = request.n() == 0 ? 1 : request.n();

  const v1::SamplingParams& sampling = request.sampling();
  if (sampling.max_tokens() < 0) {
    return invalid(absl::StrCat("sampling.max_tokens = ", sampling.max_tokens(),
                                " must be >= 0 (0: the server default, ",
                                config_.default_max_tokens, ")"));
  }
  job.max_tokens = sampling.max_tokens() == 0 ? config_.default_max_tokens : sampling.max_tokens();
  job.sampling.temperature = sampling.temperature();
  job.sampling.top_k = sampling.top_k();
  job.sampling.top_p = sampling.top_p() == 0.0f ? 1.0f : sampling.top_p();
  job.sampling.seed = sampling.seed();
  job.sampling.top_logprobs = sampling.top_logprobs();
  job.ignore_eos = sampling.ignore_eos();
  job.sampling.stop_token_ids.assign(sampling.stop_token_ids().begin(),
                                     sampling.stop_token_ids().end());
  if (absl::Status status = engine::validate_sampling_params(job.sampling, model_.vocab_size);
      !status.ok()) {
    return to_grpc(status);
  }
  size_t stop_bytes = 0;
  for (int i = 0; i < sampling.stop_size(); ++i) {
    if (sampling.stop(i).empty()) return invalid(absl::StrCat("sampling.stop[", i, "] is empty"));
    stop_bytes += sampling.stop(i).size();
    job.stop.push_back(sampling.stop(i));
  }
  if (stop_bytes > static_cast<size_t>(config_.max_text_bytes)) {
    return invalid(absl::StrCat("sampling.stop has ", stop_bytes, " bytes; the limit is ",
                                config_.max_text_bytes));
  }

  const int64_t prompt_size = static_cast<int64_t>(job.prompt.size());
  if (prompt_size + job.max_tokens > model_.max_context) {
    return invalid(absl::StrCat("prompt (", prompt_size, " tokens) + sampling.max_tokens (",
                                job.max_tokens, ") exceeds the model's context of ",
                                model_.max_context, " tokens"));
  }
  const int64_t tree_tokens = prompt_size + int64_t{job.n} * job.max_tokens;
  if (tree_tokens > config_.max_tree_tokens) {
    return invalid(absl::StrCat("the job may hold ", tree_tokens, " tokens (prompt ", prompt_size,
                                " + n ", job.n, " x max_tokens ", job.max_tokens,
                                "); the limit is ", config_.max_tree_tokens, " (max_tree_tokens)"));
  }

  absl::StatusOr<std::shared_ptr<GenerateStream>> stream = engine_.submit(std::move(job));
  if (!stream.ok()) return to_grpc(stream.status());

  bool first = true;
  std::vector<BranchDelta> deltas;
  for (;;) {
    deltas.clear();
    const bool more = (*stream)->next(deltas, kPollInterval);
    for (BranchDelta& delta : deltas) {
      v1::GenerateResponse response;
      response.set_branch(delta.branch);
      if (first) response.set_prompt_tokens(static_cast<int32_t>(prompt_size));
      first = false;
      v1::Tokens* tokens = response.mutable_delta();
      tokens->mutable_ids()->Add(delta.ids.begin(), delta.ids.end());
      tokens->set_text(std::move(delta.text));
      tokens->mutable_logprobs()->Add(delta.logprobs.begin(), delta.logprobs.end());
      for (const auto& top : delta.top_logprobs) {
        v1::TopLogprobs* entries = tokens->add_top_logprobs();
        for (const engine::TokenLogprob& entry : top) {
          v1::TokenLogprob* out = entries->add_entries();
          out->set_token(entry.token);
          out->set_logprob(entry.logprob);
        }
      }
      response.set_finish_reason(to_proto(delta.finish));
      if (!writer->Write(response)) {
        (*stream)->cancel();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      }
    }
    if (!more) break;
    if (context->IsCancelled()) {
      (*stream)->cancel();
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
    }
  }
  return to_grpc((*stream)->final_status());
}

// ---- Not yet implemented ------------------------------------------------------------------

grpc::Status DeftService::RunTree(grpc::ServerContext*, const v1::RunTreeRequest*,
                                  grpc::ServerWriter<v1::TreeEvent>*) {
  return done("RunTree", unimplemented("RunTree"));
}

grpc::Status DeftService::TreeSession(
    grpc::ServerContext*, grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>*) {
  return done("TreeSession", unimplemented("TreeSession"));
}

grpc::Status DeftService::Verify(grpc::ServerContext*, const v1::VerifyRequest*,
                                 v1::VerifyResponse*) {
  return done("Verify", unimplemented("Verify"));
}

// ---- Tokenizer and model ------------------------------------------------------------------

grpc::Status DeftService::Tokenize(grpc::ServerContext*, const v1::TokenizeRequest* request,
                                   v1::TokenizeResponse* response) {
  const auto run = [&]() -> grpc::Status {
    if (request->text().size() > static_cast<size_t>(config_.max_text_bytes)) {
      return invalid(absl::StrCat("text has ", request->text().size(), " bytes; the limit is ",
                                  config_.max_text_bytes, " (max_text_bytes)"));
    }
    absl::StatusOr<std::vector<engine::TokenId>> ids =
        tokenizer_.encode(request->text(), request->add_bos(), /*parse_special=*/false);
    if (!ids.ok()) return invalid(absl::StrCat("text: ", ids.status().message()));
    response->mutable_ids()->Add(ids->begin(), ids->end());
    return grpc::Status::OK;
  };
  return done("Tokenize", run());
}

grpc::Status DeftService::Detokenize(grpc::ServerContext*, const v1::DetokenizeRequest* request,
                                     v1::DetokenizeResponse* response) {
  const auto run = [&]() -> grpc::Status {
    const int32_t vocab = tokenizer_.vocab_size();
    if (request->ids_size() > config_.max_tree_tokens) {
      return invalid(absl::StrCat("ids has ", request->ids_size(), " tokens; the limit is ",
                                  config_.max_tree_tokens, " (max_tree_tokens)"));
    }
    for (int i = 0; i < request->ids_size(); ++i) {
      if (request->ids(i) < 0 || request->ids(i) >= vocab) {
        return invalid(absl::StrCat("ids[", i, "] = ", request->ids(i),
                                    " is outside the vocabulary [0, ", vocab, ")"));
      }
    }
    const std::vector<engine::TokenId> ids(request->ids().begin(), request->ids().end());
    response->set_text(tokenizer_.decode(ids, request->skip_special()));
    return grpc::Status::OK;
  };
  return done("Detokenize", run());
}

grpc::Status DeftService::ModelInfo(grpc::ServerContext*, const v1::ModelInfoRequest*,
                                    v1::ModelInfoResponse* response) {
  response->set_name(model_.name);
  response->set_architecture(model_.architecture);
  response->set_vocab_size(model_.vocab_size);
  response->set_max_context(static_cast<int32_t>(model_.max_context));
  response->set_num_layers(model_.num_layers);
  response->set_hidden_size(model_.hidden_size);
  response->set_num_q_heads(model_.num_q_heads);
  response->set_num_kv_heads(model_.num_kv_heads);
  response->set_dtype(model_.dtype);
  response->set_backend(model_.backend);
  response->set_attention(config_.plan);
  response->set_kv_capacity_tokens(int64_t{config_.kv_pages} * config_.page_tokens);
  response->set_bos_token_id(tokenizer_.bos_id().value_or(-1));
  response->mutable_eos_token_ids()->Add(tokenizer_.eos_ids().begin(), tokenizer_.eos_ids().end());
  response->set_page_tokens(config_.page_tokens);
  response->set_max_prompt_tokens(config_.max_prompt_tokens);
  response->set_max_tree_tokens(config_.max_tree_tokens);
  response->set_max_branches(config_.max_branches);
  return done("ModelInfo", grpc::Status::OK);
}

}  // namespace deft::server
