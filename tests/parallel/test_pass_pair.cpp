// parallel/pass_pair.h: two passes on two threads, one running at a time, switching at their yield
// points in a fixed order; exceptions carried back; nothing outside a pair.
#include <gtest/gtest.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/pass_pair.h"

namespace fp8moe {
namespace {

TEST(PassPair, PassesTakeTurnsAtTheirYieldPoints) {
  for (int round = 0; round < 50; ++round) {  // (the same order every time)
    std::vector<std::string> log;
    std::thread::id ids[2], entered;
    const std::thread::id caller = std::this_thread::get_id();
    int running = 0, most = 0;  // passes inside a step at once
    auto step = [&](const std::string& what) {
      most = std::max(most, ++running);
      log.push_back(what);
      --running;
    };
    PassPair::run(
        [&] {
          ids[0] = std::this_thread::get_id();
          EXPECT_TRUE(PassPair::active());
          step("a1"), PassPair::yield_point();
          step("a2"), PassPair::yield_point();
          step("a3"), PassPair::yield_point();
          step("a4");
        },
        [&] {
          ids[1] = std::this_thread::get_id();
          step("b1"), PassPair::yield_point();
          step("b2");
        },
        [&] { entered = std::this_thread::get_id(); });
    EXPECT_EQ(log, (std::vector<std::string>{"a1", "b1", "a2", "b2", "a3", "a4"}));
    EXPECT_EQ(ids[0], caller) << "the first pass runs on the caller's thread";
    EXPECT_NE(ids[1], caller);
    EXPECT_EQ(entered, ids[1]) << "enter_thread runs on the second pass's thread";
    EXPECT_EQ(most, 1);
  }
  EXPECT_FALSE(PassPair::active());
  PassPair::yield_point();  // outside a pair: nothing
}

TEST(PassPair, AnExceptionComesBackOnceBothPassesHaveEnded) {
  bool second_ended = false;
  try {
    PassPair::run([] { throw std::runtime_error("first"); },
                  [&] {
                    PassPair::yield_point();
                    second_ended = true;
                  });
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_TRUE(second_ended);
  EXPECT_THROW(PassPair::run([] {}, [] { throw std::logic_error("second"); }), std::logic_error);
}

}  // namespace
}  // namespace fp8moe
