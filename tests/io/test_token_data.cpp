// Token files: tokenisation and document index, the train/validation split, deterministic
// sampling, and the errors for bad inputs and bad files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <iterator>
#include <random>
#include <set>

#include "io/token_data.h"
#include "tests/test_util.h"

using namespace std::string_literals;

namespace fp8moe {
namespace {

TEST(TokenData, BytesBecomeTokensAndDocumentsEndWithZero) {
  test::TempDir dir;
  const std::string a = dir.write("a.txt", "ab\n%\ncd\n%\n\n%\ne\0f"s), b = dir.write("b.txt", "xyz");
  const PrepareReport r = prepare_data({a, b}, dir.path + "/d", 0.0, "%", 1);
  EXPECT_EQ(r.train_docs, 5);  // "ab\n", "cd\n", "\n", "e\0f" (NUL dropped), "xyz"
  EXPECT_EQ(r.val_docs, 0);
  TokenFile f(dir.path + "/d.train.tok");
  const std::vector<uint16_t> want = {'a', 'b', '\n', 0, 'c', 'd', '\n', 0, '\n', 0, 'e', 'f', 0, 'x', 'y', 'z', 0};
  ASSERT_EQ(f.size(), int64_t(want.size()));
  EXPECT_EQ(std::vector<uint16_t>(f.tokens(), f.tokens() + f.size()), want);
  EXPECT_EQ(f.docs(), 5);
  EXPECT_EQ(f.doc_start(1), 4);
  EXPECT_EQ(f.doc_start(5), 17);
  TokenFile v(dir.path + "/d.val.tok");
  EXPECT_EQ(v.size(), 0);
}

TEST(TokenData, ValidationSplitIsByDocumentDeterministicAndDisjoint) {
  test::TempDir dir;
  std::string text;
  for (int d = 0; d < 400; ++d) text += "doc" + std::to_string(d) + "\n%\n";
  const std::string in = dir.write("in.txt", text);
  const PrepareReport r = prepare_data({in}, dir.path + "/s", 0.2, "%", 7);
  EXPECT_EQ(r.train_docs + r.val_docs, 401);  // 400 and the empty tail
  EXPECT_NEAR(double(r.val_docs) / 401.0, 0.2, 0.06);
  auto docs_of = [](const TokenFile& f) {
    std::set<std::string> s;
    for (int64_t d = 0; d < f.docs(); ++d) s.insert(std::string(f.tokens() + f.doc_start(d), f.tokens() + f.doc_start(d + 1) - 1));
    return s;
  };
  const std::set<std::string> train = docs_of(TokenFile(dir.path + "/s.train.tok")), val = docs_of(TokenFile(dir.path + "/s.val.tok"));
  for (const std::string& d : val) EXPECT_EQ(train.count(d), 0u) << d;
  // Same seed, same split; another seed, another split.
  prepare_data({in}, dir.path + "/t", 0.2, "%", 7);
  EXPECT_EQ(docs_of(TokenFile(dir.path + "/t.val.tok")), val);
  prepare_data({in}, dir.path + "/u", 0.2, "%", 8);
  EXPECT_NE(docs_of(TokenFile(dir.path + "/u.val.tok")), val);
}

TEST(TokenData, SamplesAreDisjointWindowsVisitedOncePerEpoch) {
  test::TempDir dir;
  std::string text;  // random bytes: every 16-byte window is unique (checked below by search)
  std::mt19937 rng(11);
  for (uint32_t i = 0; i < 5000; ++i) text += char(1 + rng() % 255);
  prepare_data({dir.write("in.txt", text)}, dir.path + "/p", 0.0, "", 3);
  TokenFile f(dir.path + "/p.train.tok");
  const int64_t T = 16, W = f.windows(T);  // 5001 tokens: 312 windows
  ASSERT_EQ(W, (5001 - 1) / 16);
  std::vector<int32_t> x(T), y(T), x2(T), y2(T);
  f.sample(42, 77, T, x.data(), y.data());
  f.sample(42, 77, T, x2.data(), y2.data());
  EXPECT_EQ(x, x2);  // a pure function of (seed, index)
  // One epoch: every window exactly once, so no two samples (positions, ranks) share input tokens.
  std::set<int64_t> starts;
  for (int64_t i = 0; i < W; ++i) {
    f.sample(42, i, T, x.data(), y.data());
    const int64_t start = std::search(f.tokens(), f.tokens() + f.size(), x.begin(), x.end(),
                                      [](uint16_t a, int32_t b) { return a == b; }) - f.tokens();
    ASSERT_EQ(start % T, 0) << "sample " << i << " is not a window";
    EXPECT_TRUE(starts.insert(start).second) << "window at " << start << " read twice in one epoch";
    for (int64_t t = 0; t + 1 < T; ++t) ASSERT_EQ(y[t], x[t + 1]);  // targets are the next tokens
    ASSERT_EQ(y[T - 1], f.tokens()[start + T]);
  }
  EXPECT_EQ(int64_t(starts.size()), W);
  // The next epoch is another order; another seed too.
  std::vector<int64_t> e0, e1, s2;
  for (int64_t i = 0; i < 20; ++i) {
    f.sample(42, i, T, x.data(), y.data()), e0.push_back(x[0]);
    f.sample(42, W + i, T, x.data(), y.data()), e1.push_back(x[0]);
    f.sample(43, i, T, x.data(), y.data()), s2.push_back(x[0]);
  }
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, s2);
}

TEST(TokenData, PrintableUtf8KeepsValidTextAndEscapesTheRest) {
  EXPECT_EQ(printable_utf8("plain\ttext\n"), "plain\ttext\n");
  EXPECT_EQ(printable_utf8("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"), "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(printable_utf8("a\xFF" "b"), "a\\xFF" "b");            // not UTF-8 at all
  EXPECT_EQ(printable_utf8("\xC3"), "\\xC3");                      // truncated sequence
  EXPECT_EQ(printable_utf8("\xC0\xAF"), "\\xC0\\xAF");            // overlong '/'
  EXPECT_EQ(printable_utf8("\xED\xA0\x80"), "\\xED\\xA0\\x80");  // a surrogate
  EXPECT_EQ(printable_utf8("\x1B[2J\r"), "\\x1B[2J\\x0D");          // terminal control bytes
}

TEST(TokenData, BadInputsAndFilesAreClearErrors) {
  test::TempDir dir;
  EXPECT_THROW(prepare_data({}, dir.path + "/x", 0.1, "", 1), DataError);
  EXPECT_THROW(prepare_data({dir.path + "/missing.txt"}, dir.path + "/x", 0.1, "", 1), DataError);
  EXPECT_THROW(prepare_data({dir.write("empty.txt", "")}, dir.path + "/x", 0.1, "", 1), DataError);
  EXPECT_THROW(prepare_data({dir.write("t.txt", "abc")}, dir.path + "/x", 1.5, "", 1), DataError);
  prepare_data({dir.write("ok.txt", "hello world")}, dir.path + "/ok", 0.0, "", 1);
  const std::string good = dir.path + "/ok.train.tok";
  auto expect_error = [](const std::string& path, const std::string& what) {
    try {
      TokenFile f(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  };
  expect_error(dir.path + "/none.tok", "cannot open");
  std::filesystem::copy_file(good, dir.path + "/trunc.tok");
  std::filesystem::resize_file(dir.path + "/trunc.tok", std::filesystem::file_size(good) - 3);
  expect_error(dir.path + "/trunc.tok", "does not match its header");
  expect_error(dir.write("magic.tok", std::string(64, 'x')), "bad magic");
  expect_error(dir.write("short.tok", "FP8"), "shorter than its header");
  // Header fields and the index, each corrupted alone (offsets: version 8, docs 24, tokens 32).
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto patched = [&](const std::string& name, size_t at, const std::string& with) {
    std::string b = bytes;
    b.replace(at, with.size(), with);
    return dir.write(name, b);
  };
  expect_error(patched("version.tok", 8, std::string("\x02\0\0\0", 4)), "version 2");
  expect_error(patched("docs.tok", 24, std::string("\x50\0\0\0\0\0\0\0", 8)), "does not match its header");
  expect_error(patched("token.tok", 32, std::string("\x00\x01", 2)), "is not a byte");
  expect_error(patched("end.tok", 32 + 2 * 11, std::string("\x41\x00", 2)), "ending with 0");
  // Inputs: a directory, and everything held out.
  try {
    prepare_data({dir.path}, dir.path + "/x", 0.1, "", 1);
    ADD_FAILURE() << "a directory was accepted as input";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  try {
    prepare_data({dir.write("one.txt", "only one document")}, dir.path + "/x", 0.999, "", 3);
    ADD_FAILURE() << "no error with nothing to train on";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("every document went to validation"), std::string::npos) << e.what();
  }
  TokenFile f(good);
  std::vector<int32_t> x(100), y(100);
  EXPECT_THROW(f.sample(1, 0, 100, x.data(), y.data()), DataError);  // 12 tokens < 101
}

}  // namespace
}  // namespace fp8moe
