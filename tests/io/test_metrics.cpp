// The metrics log (io/metrics.h): the exact line of a step with every kind of value, and the file's
// life (its directory created, a fresh run emptying it, an unwritable path refused by name).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "io/metrics.h"
#include "tests/test_util.h"

namespace fp8moe {
namespace {

StepMetrics sample_step() {
  StepMetrics m;
  m.step = 3, m.loss = 5.25, m.val_loss = NAN, m.mtp_loss = 0.75, m.lr = 0.001, m.grad_norm = 0.5, m.tokens_per_s = 1024;
  m.step_time_s = 0.125, m.mfu = 0.0625, m.peak_mem_bytes = 123456789, m.expert_load_imbalance = 1.5;
  m.fp8_saturated = 7, m.fp8_underflowed = 0, m.skipped_steps = 1, m.loss_scale = 65536;
  m.pipeline_bubble = NAN, m.pipeline_bubble_ideal = INFINITY;
  m.host_syncs = 5, m.h2d_bytes = 2048, m.d2h_bytes = 96, m.comm_exposed_s = 0.25;
  return m;
}

TEST(Metrics, OneStepIsOneJsonObjectWithTheKeysInOrder) {
  // Numbers exactly representable in binary, so that their shortest round-trip text is known;
  // NaN and infinity are not JSON numbers: null. No device: null.
  EXPECT_EQ(metrics_json(sample_step()),
            "{\"step\":3,\"loss\":5.25,\"val_loss\":null,\"mtp_loss\":0.75,\"lr\":0.001,\"grad_norm\":0.5,\"tokens_per_s\":1024.0,"
            "\"step_time_s\":0.125,\"mfu\":0.0625,\"peak_mem_bytes\":123456789,\"peak_device_mem_bytes\":null,"
            "\"expert_load_imbalance\":1.5,\"fp8_saturated\":7,\"fp8_underflowed\":0,\"skipped_steps\":1,"
            "\"loss_scale\":65536.0,\"pipeline_bubble\":null,\"pipeline_bubble_ideal\":null,\"host_syncs\":5,"
            "\"h2d_bytes\":2048,\"d2h_bytes\":96,\"comm_exposed_s\":0.25}");
  StepMetrics gpu = sample_step();
  gpu.peak_device_mem_bytes = 4096;
  gpu.loss = 0.1;  // not exact in binary: written with the digits that read back to the same double
  const std::string line = metrics_json(gpu);
  EXPECT_NE(line.find("\"loss\":0.1,"), std::string::npos) << line;
  EXPECT_NE(line.find("\"peak_device_mem_bytes\":4096,"), std::string::npos) << line;
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Metrics, TheLogAppendsEmptiesOnRestartAndRefusesAnUnwritablePath) {
  test::TempDir dir;
  const std::string path = dir.path + "/new/dir/m.jsonl";
  {
    MetricsLog log(path);  // creates new/dir
    log.write(sample_step());
  }
  {
    MetricsLog log(path);  // a resumed run appends
    log.write(sample_step());
  }
  const std::string line = metrics_json(sample_step()) + "\n";
  EXPECT_EQ(read(path), line + line);
  {
    MetricsLog log(path);
    ASSERT_TRUE(log.restart());  // a fresh run starts an empty log
    log.write(sample_step());
  }
  EXPECT_EQ(read(path), line);
  MetricsLog none;  // no log.jsonl: writes nothing, fails nothing
  none.write(sample_step());
  EXPECT_TRUE(none.restart());
  try {
    MetricsLog bad(path + "/under/a/file.jsonl");
    FAIL() << "opened a path under a regular file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("log.jsonl: cannot write " + path + "/under/a/file.jsonl"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace fp8moe
