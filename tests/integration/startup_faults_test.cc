// Fault injection at start: the real deft-server binary pointed (--model DIR) at a copy of the
// embedded default model with one file damaged. Each must end the start with exit code 1 (the
// model could not be set up, see server/main.cc) and a message that names the damaged file —
// never a crash, a hang, or a server that starts on a broken model.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "tests/integration/server_process.h"

namespace deft::testing {
namespace {

namespace fs = std::filesystem;

// A model folder: the default model's files copied, then one of them damaged by the test.
class BrokenModel {
 public:
  explicit BrokenModel(const std::string& name)
      : dir_(fs::temp_directory_path() / ("deft-broken-" + name + "-" + std::to_string(getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const auto& entry : fs::directory_iterator(fs::path(DEFT_SOURCE_DIR) / "models/default")) {
      fs::copy_file(entry.path(), dir_ / entry.path().filename());
    }
  }
  ~BrokenModel() { fs::remove_all(dir_); }

  fs::path file(const std::string& name) const { return dir_ / name; }
  std::string read(const std::string& name) const {
    std::ifstream stream(file(name), std::ios::binary);
    return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
  }
  void write(const std::string& name, const std::string& bytes) const {
    std::ofstream(file(name), std::ios::binary | std::ios::trunc) << bytes;
  }

  // Starts the server on the folder and checks the refused start.
  void expect_refused(const std::string& damaged_file, const std::string& also_mentioned = "") {
    const ProgramResult result =
        run_program({DEFT_SERVER_BINARY, "--model", dir_.string(), "--listen", "127.0.0.1:0",
                     "--metrics-listen", "", "--kv-pages", "64"},
                    std::chrono::seconds(60));
    EXPECT_EQ(result.term_signal, 0) << "killed by a signal:\n" << result.output;
    EXPECT_EQ(result.exit_code, 1) << result.output;
    EXPECT_NE(result.output.find(file(damaged_file).string()), std::string::npos)
        << "the message does not name " << file(damaged_file) << ":\n"
        << result.output;
    if (!also_mentioned.empty()) {
      EXPECT_NE(result.output.find(also_mentioned), std::string::npos)
          << "the message does not mention '" << also_mentioned << "':\n"
          << result.output;
    }
    EXPECT_EQ(result.output.find("serving:"), std::string::npos) << result.output;
  }

 private:
  fs::path dir_;
};

// Replaces the first occurrence of `from` in `text`; fails the test when there is none.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << "'" << from << "' not found";
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST(StartupFaults, TruncatedSafetensors) {
  BrokenModel model("truncated");
  const std::string bytes = model.read("model.safetensors");
  model.write("model.safetensors", bytes.substr(0, bytes.size() / 2));
  model.expect_refused("model.safetensors", "truncated");
}

TEST(StartupFaults, SafetensorsShorterThanItsHeaderLength) {
  BrokenModel model("tiny-safetensors");
  model.write("model.safetensors", model.read("model.safetensors").substr(0, 5));
  model.expect_refused("model.safetensors");
}

TEST(StartupFaults, CorruptSafetensorsHeader) {
  BrokenModel model("corrupt-header");
  std::string bytes = model.read("model.safetensors");
  // The JSON header starts after the 8-byte length: break its syntax.
  bytes.replace(8, 8, "{\"x\":[}}");
  model.write("model.safetensors", bytes);
  model.expect_refused("model.safetensors", "JSON");
}

TEST(StartupFaults, SafetensorsHeaderLengthPastTheFile) {
  BrokenModel model("header-length");
  std::string bytes = model.read("model.safetensors");
  bytes.replace(0, 8, std::string("\xff\xff\xff\x7f\x00\x00\x00\x00", 8));
  model.write("model.safetensors", bytes);
  model.expect_refused("model.safetensors", "header length");
}

TEST(StartupFaults, MissingSafetensors) {
  BrokenModel model("no-weights");
  fs::remove(model.file("model.safetensors"));
  // Nothing to name but the folder; the message says what is missing there.
  const std::string folder = model.file("").parent_path().string();
  const ProgramResult result =
      run_program({DEFT_SERVER_BINARY, "--model", folder, "--listen", "127.0.0.1:0",
                   "--metrics-listen", "", "--kv-pages", "64"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find(folder), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("safetensors"), std::string::npos) << result.output;
}

TEST(StartupFaults, ConfigThatIsNotJson) {
  BrokenModel model("config-not-json");
  model.write("config.json", "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 12");
  model.expect_refused("config.json", "not well-formed JSON");
}

TEST(StartupFaults, ConfigMissingAField) {
  BrokenModel model("config-missing-field");
  model.write("config.json", replaced(model.read("config.json"), "\"hidden_size\"", "\"hidden\""));
  model.expect_refused("config.json", "hidden_size");
}

TEST(StartupFaults, ConfigWithAnAbsurdLayerCount) {
  BrokenModel model("config-layers");
  model.write("config.json", replaced(model.read("config.json"), "\"num_hidden_layers\": 4",
                                      "\"num_hidden_layers\": 2147483647"));
  // The config alone is well-formed; the checkpoint cannot hold that many layers, and the
  // message names the checkpoint and the field.
  model.expect_refused("model.safetensors", "num_hidden_layers = 2147483647");
}

TEST(StartupFaults, ConfigWhoseShapesOverflow) {
  BrokenModel model("config-overflow");
  std::string config = model.read("config.json");
  config = replaced(config, "\"num_attention_heads\": 4", "\"num_attention_heads\": 65536");
  config = replaced(config, "\"num_key_value_heads\": 2", "\"num_key_value_heads\": 65536");
  config = replaced(config, "\"head_dim\": 32", "\"head_dim\": 65536");
  model.write("config.json", config);
  model.expect_refused("config.json", "head_dim");
}

TEST(StartupFaults, CorruptTokenizerJson) {
  BrokenModel model("tokenizer-json");
  // tokenizer.json is preferred over tokenizer.model when both are present.
  model.write("tokenizer.json",
              "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [");
  model.expect_refused("tokenizer.json");
}

TEST(StartupFaults, TokenizerJsonOfAnUnsupportedModel) {
  BrokenModel model("tokenizer-unigram");
  model.write("tokenizer.json", "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}");
  model.expect_refused("tokenizer.json", "Unigram");
}

TEST(StartupFaults, CorruptTokenizerModel) {
  BrokenModel model("tokenizer-model");
  const std::string bytes = model.read("tokenizer.model");
  model.write("tokenizer.model", bytes.substr(0, bytes.size() / 3) + "garbage");
  model.expect_refused("tokenizer.model");
}

TEST(StartupFaults, CorruptGenerationConfig) {
  BrokenModel model("generation-config");
  model.write("generation_config.json", "{\"eos_token_id\": [2,");
  model.expect_refused("generation_config.json");
}

}  // namespace
}  // namespace deft::testing
