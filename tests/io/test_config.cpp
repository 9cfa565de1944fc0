// io/config as a library: defaults, the ready configs, --set overrides, the effective-config round
// trip and the reference text. (Bad configs through the real executable: tests/app/test_cli.cpp.)
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "io/config.h"
#include "tests/test_util.h"

namespace fp8moe {
namespace {

Config load(const std::string& yaml, std::vector<std::string> sets = {}, int world = 1) {
  return load_config(ConfigSource{"test.yaml", yaml, std::move(sets)}, world);
}

std::string error_of(const std::string& yaml, std::vector<std::string> sets = {}, int world = 1) {
  try {
    load(yaml, std::move(sets), world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Config, EmptyDocumentGivesTheDefaults) {
  EXPECT_EQ(load(""), Config{});
  EXPECT_EQ(load("model:\n"), Config{});  // an empty section keeps its defaults
  EXPECT_EQ(load("# only a comment\n"), Config{});
}

TEST(Config, DocumentedDefaults) {
  // The defaults promised in model/config.h and the README, spelled out independently.
  const Config c;
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.moe.gating, Gating::sigmoid);
  EXPECT_EQ(c.parallel.tensor * c.parallel.pipeline * c.parallel.expert, 1);
  EXPECT_EQ(c.fp8.recipe, Fp8Recipe::blockwise);
  EXPECT_EQ(c.fp8.tile, 128);
  EXPECT_TRUE(c.fp8.power_of_two_scales);
  EXPECT_EQ(c.fp8.amax_history_len, 1024);  // Transformer Engine's DelayedScaling default
  EXPECT_EQ(c.train.beta2, 0.95);
  EXPECT_EQ(c.train.loss_scale.mode, LossScaleMode::none);
  EXPECT_EQ(c.checkpoint.resume, "auto");
}

TEST(Config, TinyYamlIsTheIssuesTinyModel) {
  const std::string path = test::source_dir() + "/configs/tiny.yaml";
  const Config c = load_config(ConfigSource{path, read_config_file(path), {}}, 8);
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.d_model, 256);
  EXPECT_EQ(c.model.n_layers, 4);
  EXPECT_EQ(c.model.first_dense_layers, 1);
  EXPECT_EQ(c.model.d_ff_dense, 1024);
  EXPECT_EQ(c.model.n_heads, 8);
  EXPECT_EQ(c.model.head_dim, 32);
  EXPECT_EQ(c.model.moe.n_experts, 8);
  EXPECT_EQ(c.model.moe.top_k, 2);
  EXPECT_EQ(c.model.moe.n_shared_experts, 1);
  EXPECT_EQ(c.model.moe.d_expert, 256);
  EXPECT_EQ(c.model.moe.gating, Gating::sigmoid);
  EXPECT_EQ(c.train.seq_len, 256);
  EXPECT_EQ(c.train.global_batch, 8);
  EXPECT_EQ(c.fp8.recipe, Fp8Recipe::blockwise);
  EXPECT_EQ(c.fp8.tile, 128);
  EXPECT_EQ(c.parallel.tensor, 2);
  EXPECT_EQ(c.parallel.pipeline, 2);
  EXPECT_EQ(c.parallel.expert, 2);
  // 8 ranks is its layout; 4 leaves data = 1, which expert 2 cannot divide.
  EXPECT_THROW(load_config(ConfigSource{path, read_config_file(path), {}}, 4), ConfigError);
  // Its shapes divide for each of tensor 2, pipeline 2, expert 2 alone too (the later layout tests).
  for (const char* s : {"parallel.tensor=1", "parallel.pipeline=1", "parallel.expert=1"})
    EXPECT_NO_THROW(load_config(ConfigSource{path, read_config_file(path), {s}}, 4)) << s;
}

TEST(Config, ScalarForms) {
  const Config c = load(
      "model:\n  rope_theta: 500000\n  norm_eps: 1e-5\ntrain:\n  lr: +0.5\n  seed: +7\n"
      "fp8:\n  power_of_two_scales: False\n  layers: []\n");
  EXPECT_EQ(c.model.rope_theta, 500000.0);  // an integer is a valid number
  EXPECT_EQ(c.model.norm_eps, 1e-5);
  EXPECT_EQ(c.train.lr, 0.5);
  EXPECT_EQ(c.train.seed, 7);
  EXPECT_FALSE(c.fp8.power_of_two_scales);
  EXPECT_EQ(c.fp8.layers, (Fp8Layers{false, false, false, false}));
}

TEST(Config, LossScaleForms) {
  EXPECT_EQ(load("train:\n  loss_scale: dynamic\n").train.loss_scale.mode, LossScaleMode::dynamic);
  const LossScale fixed = load("train:\n  loss_scale: 1024\n").train.loss_scale;
  EXPECT_EQ(fixed.mode, LossScaleMode::fixed);
  EXPECT_EQ(fixed.value, 1024.0);
}

TEST(Config, OverridesWinInOrderAndCreateSections) {
  const Config c = load("train:\n  lr: 0.1\n  min_lr: 0.01\n",
                        {"train.lr=0.2", "train.lr=0.3", "model.moe.top_k=3", "data.path=a=b",
                         "fp8.layers=[experts, attention]", "checkpoint.resume=none"});
  EXPECT_EQ(c.train.lr, 0.3);        // the last --set wins over the file and earlier --set
  EXPECT_EQ(c.train.min_lr, 0.01);   // untouched key of the file
  EXPECT_EQ(c.model.moe.top_k, 3);   // section created by --set
  EXPECT_EQ(c.data.path, (std::vector<DataSource>{{1.0, "a=b"}}));  // only the first '=' splits
  EXPECT_EQ(c.fp8.layers, (Fp8Layers{true, false, true, false}));
  EXPECT_EQ(c.checkpoint.resume, "none");
}

TEST(Config, DataBlends) {
  const Config c = load("data:\n  path: [[0.7, corpora/web_text_document], [3, 'code x']]\n  valid_path: v\n", {});
  EXPECT_EQ(c.data.path, (std::vector<DataSource>{{0.7, "corpora/web_text_document"}, {3.0, "code x"}}));
  EXPECT_EQ(c.data.valid_path, (std::vector<DataSource>{{1.0, "v"}}));
  EXPECT_TRUE(load("data: {path: '', valid_path: null}\n", {}).data.path.empty());
  EXPECT_TRUE(load("", {}).data.valid_path.empty());
}

TEST(Config, EffectiveConfigRoundTrips) {
  Config c;  // every section changed, set directly (not through the parser)
  c.model.vocab_size = 1000;
  c.model.n_kv_heads = 2;
  c.model.norm_eps = 1.25e-7;
  c.model.moe.gating = Gating::softmax;
  c.model.moe.capacity_factor = 1.25;
  c.parallel.micro_batches = 2;
  c.train.seed = 987654321012345LL;
  c.train.lr = 0.1 + 0.2;  // not exactly representable: the text must round-trip the double
  c.train.schedule = Schedule::linear;
  c.train.moments_dtype = MomentsDtype::bf16;
  c.train.loss_scale = {LossScaleMode::fixed, 65536.0};
  c.train.recompute = Recompute::moe;
  c.fp8.recipe = Fp8Recipe::delayed;
  c.fp8.format = Fp8Format::hybrid;
  c.fp8.amax_compute = AmaxCompute::most_recent;
  c.fp8.layers = {false, true, false, true};
  c.data.path = {{1.0, "data/with: colon # and hash"}};
  c.data.valid_path = {{0.7, "a"}, {0.1 + 0.2, "b [x]"}};
  c.eval.every = 0;
  c.checkpoint.dir = "/scratch/ckpt";
  c.log.jsonl = "";
  const std::string yaml = config_to_yaml(c);
  EXPECT_EQ(load(yaml), c) << yaml;
  EXPECT_EQ(config_to_yaml(load(yaml)), yaml);
}

TEST(Config, ReferenceIsValidYamlOfTheDefaults) {
  const std::string ref = config_reference();
  EXPECT_EQ(load(ref), Config{}) << ref;
  // Every key of the effective config is documented in the reference.
  std::istringstream lines(config_to_yaml(Config{}));
  for (std::string line; std::getline(lines, line);) {
    const std::string key = line.substr(0, line.find(':') + 1);
    EXPECT_NE(ref.find(key), std::string::npos) << key;
  }
}

TEST(Config, WorldSizeRulesOnlyWhenAWorldIsGiven) {
  const std::string yaml = "parallel:\n  tensor: 2\n  pipeline: 2\n  expert: 2\n";
  EXPECT_NO_THROW(load(yaml, {}, 0));  // 0: no world yet (shape rules only)
  EXPECT_NO_THROW(load(yaml, {}, 8));
  EXPECT_NO_THROW(load(yaml, {}, 16));
  EXPECT_NE(error_of(yaml, {}, 12).find("parallel.expert: got 2, expected a divisor of the data-parallel size 3"),
            std::string::npos)
      << error_of(yaml, {}, 12);
  EXPECT_NE(error_of(yaml, {}, 6).find("parallel.pipeline"), std::string::npos) << error_of(yaml, {}, 6);
}

TEST(Config, MessagesNameFileLineColumnKeyValueAndExpectation) {
  EXPECT_EQ(error_of("model:\n  n_layers: many\n"),
            "test.yaml:2:13: model.n_layers: got 'many', expected an integer in [1, 4096]");
  EXPECT_EQ(error_of("", {"train.steps=0"}), "--set train.steps=0: train.steps: got '0', expected an integer >= 1");
  EXPECT_EQ(error_of("model:\n  n_heads: 6\n"),
            "test.yaml (default value): model.n_kv_heads: got 8 (the default), expected a divisor of model.n_heads = 6 "
            "(grouped-query attention)");
}

TEST(Config, ReadConfigFileErrors) {
  EXPECT_THROW(read_config_file("/nonexistent/fp8moe.yaml"), ConfigError);
  EXPECT_THROW(read_config_file("/"), ConfigError);
}

TEST(Config, EditDistance) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
  EXPECT_EQ(edit_distance("d_modle", "d_model"), 2u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("n_expert", "n_experts"), 1u);
}

}  // namespace
}  // namespace fp8moe
