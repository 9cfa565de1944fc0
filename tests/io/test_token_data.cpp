// Token data: byte-level preparation, Megatron's indexed format read against an independent NumPy
// reader and writer (tests/io/megatron_format.py, written from the format's description), every
// dtype, deterministic sampling, blends, and damaged files refused with the file and the field named
// (by the reader, and by `fp8moe train` with exit 2).
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include "io/token_data.h"
#include "tests/test_util.h"

using namespace std::string_literals;

namespace fp8moe {
namespace {

std::string format_py() { return test::source_dir() + "/tests/io/megatron_format.py"; }

// The NumPy reader's view of a data set: its dtype line, the token stream, the document indices.
struct Dump {
  std::string header;
  std::vector<int64_t> tokens, doc_index;
};
Dump numpy_dump(const std::string& prefix) {
  const test::RunResult r = test::run({test::python(), format_py(), "dump", prefix});
  EXPECT_EQ(r.status, 0) << r.all();
  Dump d;
  std::istringstream in(r.out);
  std::getline(in, d.header);
  std::string line;
  std::getline(in, line);
  std::istringstream t(line);
  d.tokens.assign(std::istream_iterator<int64_t>(t), {});
  std::getline(in, line);
  std::istringstream di(line);
  d.doc_index.assign(std::istream_iterator<int64_t>(di), {});
  return d;
}

std::vector<int64_t> stream(const IndexedDataset& s) {
  std::vector<int64_t> v(size_t(s.size()));
  for (int64_t i = 0; i < s.size(); ++i) v[size_t(i)] = s.token(i);
  return v;
}

TEST(TokenData, BytesBecomeTokensAndDocumentsEndWithZero) {
  test::TempDir dir;
  const std::string a = dir.write("a.txt", "ab\n%\ncd\n%\n\n%\ne\0f"s), b = dir.write("b.txt", "xyz");
  const PrepareReport r = prepare_data({a, b}, dir.path + "/d", 0.0, "%", 1);
  EXPECT_EQ(r.train_docs, 5);
  EXPECT_EQ(r.val_docs, 0);
  // "ab\n" 0 "cd\n" 0 "\n" 0 "ef" 0 (NUL dropped) "xyz" 0
  const std::vector<int64_t> want = {'a', 'b', '\n', 0, 'c', 'd', '\n', 0, '\n', 0, 'e', 'f', 0, 'x', 'y', 'z', 0};
  IndexedDataset f(dir.path + "/d.train", TokenCheck{256});
  EXPECT_EQ(stream(f), want);
  EXPECT_EQ(f.sequences(), 5);
  EXPECT_EQ(f.documents(), 5);
  EXPECT_STREQ(f.dtype_name(), "uint16");
  // The independent reader sees the same: Megatron's uint16, one sequence per document.
  const Dump d = numpy_dump(dir.path + "/d.train");
  EXPECT_EQ(d.header, "dtype uint16 sequences 5 documents 5 tokens 17");
  EXPECT_EQ(d.tokens, want);
  EXPECT_EQ(d.doc_index, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  IndexedDataset v(dir.path + "/d.val", TokenCheck{256});  // empty, but a valid data set
  EXPECT_EQ(v.size(), 0);
  EXPECT_EQ(v.documents(), 0);
}

TEST(TokenData, SplitIsDeterministicAndSeeded) {
  test::TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "doc " + std::to_string(i) + "\n%\n";
  const std::string in = dir.write("in.txt", text);
  const PrepareReport r = prepare_data({in}, dir.path + "/s", 0.2, "%", 7);
  EXPECT_EQ(r.train_docs + r.val_docs, 201);
  // Each document goes to validation with probability 0.2: over 201 the share's standard error is
  // sqrt(0.2 * 0.8 / 201) = 0.028, and 0.08 is 2.8 of it (seeded: the same share on every run).
  EXPECT_NEAR(double(r.val_docs) / 201, 0.2, 0.08);
  auto docs_of = [](const std::string& prefix) {  // documents as text, through the NumPy reader
    const Dump d = numpy_dump(prefix);
    std::set<std::string> s;
    std::string cur;
    for (int64_t t : d.tokens) {
      if (t != 0) {
        cur += char(t);
      } else {
        s.insert(cur);
        cur.clear();
      }
    }
    return s;
  };
  const std::set<std::string> train = docs_of(dir.path + "/s.train"), val = docs_of(dir.path + "/s.val");
  for (const std::string& v : val) EXPECT_EQ(train.count(v), 0u) << v;
  prepare_data({in}, dir.path + "/t", 0.2, "%", 7);
  EXPECT_EQ(docs_of(dir.path + "/t.val"), val);
  prepare_data({in}, dir.path + "/u", 0.2, "%", 8);
  EXPECT_NE(docs_of(dir.path + "/u.val"), val);
}

// Files written by the NumPy writer in every integer dtype Megatron has, with several sequences
// per document: token k of the stream is (7k + 3) mod M, exactly predictable.
TEST(TokenData, ReadsEveryMegatronDtypeWrittenByNumpy) {
  test::TempDir dir;
  const struct {
    const char* dtype;
    int64_t mod;
  } cases[] = {{"uint8", 256}, {"int8", 128}, {"int16", 32000}, {"uint16", 65535}, {"int32", 129280}, {"int64", 1 << 20}};
  for (const auto& c : cases) {
    const std::string prefix = dir.path + "/" + c.dtype;
    const test::RunResult w = test::run({test::python(), format_py(), "write", prefix, c.dtype,
                                         "docs:7,seqs:3,len:5,mod:" + std::to_string(c.mod)});
    ASSERT_EQ(w.status, 0) << w.all();
    IndexedDataset f(prefix, TokenCheck{c.mod});
    EXPECT_STREQ(f.dtype_name(), c.dtype);
    EXPECT_EQ(f.sequences(), 21);
    EXPECT_EQ(f.documents(), 7);
    int64_t n = 0;  // sequence j of document d: 5 + (d + j) % 3 tokens
    for (int d = 0; d < 7; ++d)
      for (int j = 0; j < 3; ++j) n += 5 + (d + j) % 3;
    ASSERT_EQ(f.size(), n) << c.dtype;
    for (int64_t k = 0; k < n; ++k) ASSERT_EQ(f.token(k), (k * 7 + 3) % c.mod) << c.dtype << " token " << k;
    // A vocabulary one short of the largest id: that id is named, at its first position.
    int64_t top = 0, first_top = 0;
    for (int64_t k = 0; k < n; ++k)
      if ((k * 7 + 3) % c.mod > top) top = (k * 7 + 3) % c.mod, first_top = k;
    try {
      IndexedDataset g(prefix, TokenCheck{top});
      ADD_FAILURE() << c.dtype << ": an id past the vocabulary was accepted";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(prefix + ".bin: token id " + std::to_string(top) + " at token " +
                                           std::to_string(first_top) + " is outside the vocabulary"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(TokenData, SamplesAreDisjointWindowsVisitedOncePerEpoch) {
  test::TempDir dir;
  std::string text;  // random bytes: every 16-byte window is unique (checked below by search)
  std::mt19937 rng(11);
  for (uint32_t i = 0; i < 5000; ++i) text += char(1 + rng() % 255);
  prepare_data({dir.write("in.txt", text)}, dir.path + "/p", 0.0, "", 3);
  IndexedDataset f(dir.path + "/p.train", TokenCheck{256});
  const std::vector<int64_t> all = stream(f);
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
    const int64_t start = std::search(all.begin(), all.end(), x.begin(), x.end(),
                                      [](int64_t a, int32_t b) { return a == b; }) - all.begin();
    ASSERT_EQ(start % T, 0) << "sample " << i << " is not a window";
    EXPECT_TRUE(starts.insert(start).second) << "window at " << start << " read twice in one epoch";
    for (int64_t t = 0; t + 1 < T; ++t) ASSERT_EQ(y[t], x[t + 1]);  // targets are the next tokens
    ASSERT_EQ(y[T - 1], all[size_t(start + T)]);
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

// Small data sets for the blend's arithmetic (their tokens do not matter here).
std::vector<DataSource> constant_sets(const test::TempDir& dir, const std::vector<double>& weights) {
  std::vector<DataSource> sources;
  for (size_t k = 0; k < weights.size(); ++k) {
    const std::string prefix = dir.path + "/c" + std::to_string(k);
    const test::RunResult w = test::run({test::python(), format_py(), "write", prefix, "uint8",
                                         "docs:4,seqs:1,len:40,mod:256"});
    EXPECT_EQ(w.status, 0) << w.all();
    sources.push_back({weights[k], prefix});
  }
  return sources;
}

TEST(DataBlend, FollowsTheWeightsExactlyAndIsAPureFunctionOfTheIndex) {
  test::TempDir dir;
  // 3:1 gives A A B A per four samples (A leads on the tie at sample 1), 1:1 alternates.
  DataBlend b31(constant_sets(dir, {0.75, 0.25}), TokenCheck{});
  std::string pattern;
  for (int64_t i = 0; i < 12; ++i) pattern += char('A' + b31.locate(i).first);
  EXPECT_EQ(pattern, "AABAAABAAABA");
  EXPECT_EQ(b31.locate(6), (std::pair<int, int64_t>{1, 1}));  // the second B: B's sample 1
  EXPECT_EQ(b31.locate(8), (std::pair<int, int64_t>{0, 6}));
  DataBlend b11(constant_sets(dir, {2.0, 2.0}), TokenCheck{});  // weights are normalised
  pattern.clear();
  for (int64_t i = 0; i < 6; ++i) pattern += char('A' + b11.locate(i).first);
  EXPECT_EQ(pattern, "ABABAB");
  // Every prefix of n samples: no data set a whole sample ahead of weight x n, none more than
  // (data sets - 1) behind; each data set's samples taken in order; asking in any order gives the
  // same answers as in order.
  const std::vector<double> w = {0.5, 0.3, 0.15, 0.05};
  DataBlend blend(constant_sets(dir, w), TokenCheck{});
  std::vector<int64_t> taken(w.size(), 0);
  std::vector<std::pair<int, int64_t>> in_order;
  double ahead = 0, behind = 0;
  for (int64_t n = 0; n < 5000; ++n) {
    const auto [k, local] = blend.locate(n);
    ASSERT_EQ(local, taken[size_t(k)]) << "sample " << n;  // each data set's samples in order, none skipped
    ++taken[size_t(k)];
    in_order.push_back({k, local});
    for (size_t j = 0; j < w.size(); ++j) {
      ahead = std::max(ahead, double(taken[j]) - w[j] * double(n + 1));
      behind = std::max(behind, w[j] * double(n + 1) - double(taken[j]));
    }
  }
  std::printf("blend 0.5/0.3/0.15/0.05 over 5000 samples: worst ahead %.3f, worst behind %.3f\n", ahead, behind);
  EXPECT_LT(ahead, 1.0);
  EXPECT_LT(behind, 1.0);  // measured 0.60
  std::mt19937 rng(5);
  for (int q = 0; q < 200; ++q) {  // jumps backwards and forwards (a resume, an evaluation)
    const int64_t i = int64_t(rng() % 5000);
    ASSERT_EQ(blend.locate(i), in_order[size_t(i)]) << "sample " << i;
  }
}

TEST(DataBlend, StaysWithinItsBoundsForRandomWeights) {
  test::TempDir dir;
  const std::vector<DataSource> eight = constant_sets(dir, std::vector<double>(8, 1.0));
  std::mt19937 rng(17);
  double worst_ahead = 0, worst_behind_ratio = 0;  // behind / (data sets - 1)
  for (int trial = 0; trial < 300; ++trial) {
    const size_t K = 2 + rng() % 7;
    std::vector<DataSource> sources(eight.begin(), eight.begin() + K);
    double total = 0;
    for (auto& s : sources) total += s.weight = std::exp(5.0 * std::uniform_real_distribution<double>()(rng));
    DataBlend blend(sources, TokenCheck{});
    std::vector<int64_t> taken(K, 0);
    for (int64_t n = 0; n < 1000; ++n) {
      ++taken[size_t(blend.locate(n).first)];
      for (size_t j = 0; j < K; ++j) {
        const double share = sources[j].weight / total * double(n + 1);
        worst_ahead = std::max(worst_ahead, double(taken[j]) - share);
        worst_behind_ratio = std::max(worst_behind_ratio, (share - double(taken[j])) / double(K - 1));
      }
    }
  }
  std::printf("300 random blends of 2-8 data sets (weights spanning e^5), 1000 samples each: worst ahead %.3f, "
              "worst behind %.3f x (data sets - 1)\n", worst_ahead, worst_behind_ratio);
  EXPECT_LT(worst_ahead, 1.0);
  EXPECT_LT(worst_behind_ratio, 1.0);
}

TEST(DataBlend, SamplesComeFromTheirDataSet) {
  test::TempDir dir;
  std::vector<DataSource> sources;
  for (int k = 0; k < 2; ++k) {  // data set k: bytes 'a' + k, one document
    const std::string in = dir.write("in" + std::to_string(k), std::string(300, char('a' + k)));
    prepare_data({in}, dir.path + "/s" + std::to_string(k), 0.0, "", 1);
    sources.push_back({k == 0 ? 0.25 : 0.75, dir.path + "/s" + std::to_string(k) + ".train"});
  }
  DataBlend blend(sources, TokenCheck{256});
  const int64_t T = 8;
  std::vector<int32_t> x(T), y(T);
  for (int64_t i = 0; i < 40; ++i) {
    blend.sample(9, i, T, x.data(), y.data());
    const int k = blend.locate(i).first;
    for (int64_t t = 0; t < T; ++t) {
      if (x[t] != 0) {
        ASSERT_EQ(x[t], 'a' + k) << "sample " << i;  // 0 only at the document's end
      }
    }
  }
}

TEST(TokenData, BadInputsAreClearErrors) {
  test::TempDir dir;
  EXPECT_THROW(prepare_data({}, dir.path + "/x", 0.1, "", 1), DataError);
  EXPECT_THROW(prepare_data({dir.path + "/missing.txt"}, dir.path + "/x", 0.1, "", 1), DataError);
  EXPECT_THROW(prepare_data({dir.write("empty.txt", "")}, dir.path + "/x", 0.1, "", 1), DataError);
  EXPECT_THROW(prepare_data({dir.write("t.txt", "abc")}, dir.path + "/x", 1.5, "", 1), DataError);
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
  prepare_data({dir.write("ok.txt", "hello world")}, dir.path + "/ok", 0.0, "", 1);
  IndexedDataset f(dir.path + "/ok.train", TokenCheck{256});
  std::vector<int32_t> x(100), y(100);
  EXPECT_THROW(f.sample(1, 0, 100, x.data(), y.data()), DataError);  // 12 tokens < 101
}

// A one-step training config for runs that must fail on their data (data.path set by --set).
std::string tiny_train_config(const test::TempDir& dir) {
  return dir.write(
      "cfg.yaml",
      "model: {d_model: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, head_dim: 16, first_dense_layers: 1, d_ff_dense: 64}\n"
      "train: {steps: 1, warmup_steps: 0, global_batch: 1, seq_len: 8}\n"
      "eval: {every: 0}\n"
      "checkpoint: {dir: " + dir.path + "/ckpt, resume: none}\n");
}

// Damaged data sets: each refused by the reader with the file and the field named, and by
// `fp8moe train` with exit 2 and the same message. The good data set: "hello world" + 0 and
// "second doc" + 0 as uint16, two sequences, two documents (.idx: 34-byte header, lengths at 34,
// pointers at 42, document indices at 58; 82 bytes).
TEST(TokenData, DamagedFilesAreRefusedNamingFileAndField) {
  test::TempDir dir;
  prepare_data({dir.write("a.txt", "hello world"), dir.write("b.txt", "second doc")}, dir.path + "/good", 0.0, "", 1);
  const std::string good = dir.path + "/good.train";
  ASSERT_EQ(std::filesystem::file_size(good + ".idx"), 82u);
  ASSERT_EQ(std::filesystem::file_size(good + ".bin"), 46u);
  const std::string cfg = tiny_train_config(dir);

  // A copy of the good pair with `edit` applied to one of its files.
  int n = 0;
  auto damaged = [&](const std::string& ext, const std::function<void(std::string&)>& edit) {
    const std::string prefix = dir.path + "/bad" + std::to_string(n++);
    for (const char* e : {".idx", ".bin"}) std::filesystem::copy_file(good + e, prefix + e);
    std::ifstream in(prefix + ext, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    in.close();
    edit(bytes);
    std::ofstream(prefix + ext, std::ios::binary | std::ios::trunc) << bytes;
    return prefix;
  };
  auto patch = [](size_t at, std::string with) { return [=](std::string& b) { b.replace(at, with.size(), with); }; };
  auto le64 = [](int64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
  auto expect_refused = [&](const std::string& prefix, const std::string& file, const std::string& message) {
    SCOPED_TRACE(message);
    try {
      IndexedDataset d(prefix, TokenCheck{256});
      ADD_FAILURE() << prefix << ": accepted";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(prefix + file + ": " + message), std::string::npos) << e.what();
      std::printf("refused: %s\n", e.what() + dir.path.size() + 1);  // the table of the README and the note
    }
    const test::RunResult r = test::run({test::exe(), "train", cfg, "--set", "data.path=" + prefix});
    EXPECT_EQ(r.status, 2) << r.all();
    EXPECT_NE(r.err.find("fp8moe: error: data.path: " + prefix + file + ": " + message), std::string::npos) << r.err;
  };

  expect_refused(damaged(".idx", [](std::string& b) { b.resize(20); }), ".idx", "header: 20 bytes, shorter than");
  expect_refused(damaged(".idx", [](std::string& b) { b.resize(70); }), ".idx",
                 "size: 70 bytes, but the header's 2 sequences and 3 document entries need 82");
  expect_refused(damaged(".bin", [](std::string& b) { b.resize(40); }), ".idx",
                 "sequence_pointers[1]: 24 (+ 11 tokens of uint16): past the end of");
  expect_refused(damaged(".bin", [](std::string& b) { b += "xx"; }), ".bin",
                 "size: 48 bytes, but " + dir.path + "/bad3.idx's sequences end at byte 46");
  expect_refused(damaged(".idx", patch(0, "MMIDIDY")), ".idx", "magic: not MMIDIDX");
  expect_refused(damaged(".idx", patch(9, "\x02")), ".idx", "version: 2, this build reads version 1");
  expect_refused(damaged(".idx", patch(17, "\x09")), ".idx", "dtype: code 9 is not one of Megatron's");
  expect_refused(damaged(".idx", patch(17, "\x07")), ".idx", "dtype: code 7 (a floating-point type) holds no token ids");
  expect_refused(damaged(".idx", patch(17, "\x04")), ".idx", "sequence_pointers[0]: 0 (+ 12 tokens of int32): past the end");
  expect_refused(damaged(".idx", patch(18, le64(3))), ".idx", "size: 82 bytes, but the header's 3 sequences");
  expect_refused(damaged(".idx", patch(18, le64(int64_t(1) << 40))), ".idx", "sequence/document count: 1099511627776 sequences");
  // Counts whose index size (12 bytes a sequence, 8 a document) overflows 64 bits: refused for the
  // count, before any size arithmetic.
  expect_refused(damaged(".idx", patch(18, le64((int64_t(1) << 62) + 1))), ".idx",
                 "sequence/document count: 4611686018427387905 sequences, 3 document entries: impossible in 82 bytes");
  expect_refused(damaged(".idx", patch(26, le64((int64_t(1) << 61) + 2))), ".idx",
                 "sequence/document count: 2 sequences, 2305843009213693954 document entries: impossible in 82 bytes");
  expect_refused(damaged(".idx", patch(50, le64(4000))), ".idx", "sequence_pointers[1]: 4000 (+ 11 tokens of uint16): past the end");
  expect_refused(damaged(".idx", patch(50, le64(22))), ".idx",
                 "sequence_pointers[1]: 22, expected 24 (the end of the sequence before it)");
  expect_refused(damaged(".idx", patch(38, "\xff\xff\xff\xff")), ".idx", "sequence_lengths[1]: -1, negative");
  expect_refused(damaged(".idx", patch(58, le64(1))), ".idx", "document_indices[0]: 1, expected 0");
  expect_refused(damaged(".idx", patch(74, le64(1))), ".idx", "document_indices[2]: 1, the last entry must be the sequence count 2");
  expect_refused(damaged(".idx", patch(66, le64(5))), ".idx", "document_indices[1]: 5: not in [0, 2]");
  expect_refused(damaged(".bin", patch(4, std::string("\x00\x01", 2))), ".bin",
                 "token id 256 at token 2 is outside the vocabulary [0, 256)");
  expect_refused(dir.path + "/none", ".idx", "cannot open the index (Megatron .idx)");
  {  // A negative id: the dtype made int16, token 2 made 0xFFFF.
    const std::string prefix = damaged(".idx", patch(17, "\x03"));
    std::fstream bin(prefix + ".bin", std::ios::in | std::ios::out | std::ios::binary);
    bin.seekp(4);
    bin.write("\xff\xff", 2);
    bin.close();
    expect_refused(prefix, ".bin", "token id -1 at token 2 is outside the vocabulary [0, 256)");
  }
  // Each rank checks its part of the ids: with 2 ranks the bad id at token 20 of 23 is rank 1's to
  // find, and every rank still exits 2, rank 0 printing rank 1's message once.
  const std::string late = damaged(".bin", patch(40, std::string("\x00\x02", 2)));  // token 20: id 512
  EXPECT_NO_THROW(IndexedDataset(late, TokenCheck{256, 0, 2}));
  EXPECT_THROW(IndexedDataset(late, TokenCheck{256, 1, 2}), DataError);
  const test::RunResult r = test::run({test::mpiexec(), "-n", "2", test::exe(), "train", cfg, "--set",
                                       "train.global_batch=2", "--set", "data.path=" + late});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("fp8moe: error: data.path: " + late + ".bin: token id 512 at token 20 is outside"), std::string::npos)
      << r.err;
  EXPECT_EQ(test::count(r.err, "fp8moe: error:"), 1u) << r.err;
}


// A .idx or .bin that is not a regular file is refused at once, naming the path and what it is: a
// FIFO (an open for reading would wait for a writer) or a character device such as /dev/zero
// (endless). By `fp8moe train` with exit 2, under `timeout 20` so that a reader that blocks fails
// the test instead of hanging it (status 124), alone and in a blend; then by the reader itself.
TEST(TokenData, FifosAndDevicesAreRefusedWithoutBlocking) {
  test::TempDir dir;
  prepare_data({dir.write("a.txt", "hello world, and more")}, dir.path + "/good", 0.0, "", 1);
  const std::string good = dir.path + "/good.train", cfg = tiny_train_config(dir);
  // A copy of the good pair whose file `ext` is made by `make`.
  auto with = [&](const std::string& name, const std::string& ext, void (*make)(const std::string&)) {
    const std::string prefix = dir.path + "/" + name;
    for (const std::string e : {".idx", ".bin"})
      if (e != ext) std::filesystem::copy_file(good + e, prefix + e);
    make(prefix + ext);
    return prefix;
  };
  auto fifo = [](const std::string& p) { EXPECT_EQ(mkfifo(p.c_str(), 0600), 0) << p; };
  auto zero = [](const std::string& p) { std::filesystem::create_symlink("/dev/zero", p); };
  const std::string idx = "index (Megatron .idx)", bin = "token file (Megatron .bin)";
  const struct {
    std::string prefix, file, what;
  } cases[] = {{with("fifo_idx", ".idx", fifo), ".idx", idx + " is not a regular file (a FIFO)"},
               {with("fifo_bin", ".bin", fifo), ".bin", bin + " is not a regular file (a FIFO)"},
               {with("zero_idx", ".idx", zero), ".idx", idx + " is not a regular file (a character device)"},
               {with("zero_bin", ".bin", zero), ".bin", bin + " is not a regular file (a character device)"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.prefix + c.file);
    const std::string want = c.prefix + c.file + ": the " + c.what;
    for (const std::string& path : {c.prefix, "[[1, " + good + "], [1, " + c.prefix + "]]"}) {
      // (train catches SIGTERM to save a checkpoint, so timeout's TERM is followed by a KILL)
      const test::RunResult r =
          test::run({"timeout", "-k", "5", "20", test::exe(), "train", cfg, "--set", "data.path=" + path}, 60);
      const bool blocked = r.status == 124 || r.status == 137 || r.timed_out;
      EXPECT_EQ(r.status, 2) << (blocked ? "blocked: killed by timeout 20\n" : "") << r.err;
      EXPECT_NE(r.err.find("fp8moe: error: data.path: " + want), std::string::npos) << r.err;
      EXPECT_EQ(test::count(r.err, "\n"), 1u) << r.err;
      if (blocked) return;  // the reader would block this process too
    }
    try {
      IndexedDataset d(c.prefix, TokenCheck{256});
      ADD_FAILURE() << "accepted";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
}

// The files of `dir`, each as "SIZE bytes, FNV-1a HASH" of its contents.
std::map<std::string, std::string> files_of(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), {});
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
    files[e.path().filename().string()] = std::to_string(bytes.size()) + " bytes, FNV-1a " + std::to_string(h);
  }
  return files;
}

// prepare-data writes its four files under temporary names and renames them into place when all
// four are complete. A run that fails, on an input or halfway through writing (the validation
// set's .bin past a file-size limit, RLIMIT_FSIZE, after the training set's files were written),
// leaves the previous outputs byte for byte and no temporary file; one that succeeds replaces all.
TEST(TokenData, AFailedPrepareLeavesThePreviousOutputs) {
  test::TempDir dir;
  const std::string out = dir.path + "/out", prefix = out + "/p";
  std::string old_text, new_text;
  for (int i = 0; i < 400; ++i) {
    old_text += "old document " + std::to_string(i) + "\n%\n";
    new_text += "a new document, number " + std::to_string(i) + "\n%\n";
  }
  const std::string old_in = dir.write("old.txt", old_text), new_in = dir.write("new.txt", new_text);
  prepare_data({old_in}, prefix, 0.9, "%", 1);
  const auto before = files_of(out);
  ASSERT_EQ(before.size(), 4u);
  // ~360 validation documents of ~25 bytes: a .bin of ~18 KB, past 8 KiB; the training set's ~40, not.
  EXPECT_THROW(prepare_data({new_in, dir.path}, prefix, 0.9, "%", 1), DataError);  // a directory as input
  EXPECT_EQ(files_of(out), before);
  {
    rlimit old_limit{};
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
    rlimit low = old_limit;
    low.rlim_cur = 8192;
    const auto old_handler = signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &low), 0);
    std::string error;
    try {
      prepare_data({new_in}, prefix, 0.9, "%", 1);
    } catch (const DataError& e) {
      error = e.what();
    }
    setrlimit(RLIMIT_FSIZE, &old_limit);
    signal(SIGXFSZ, old_handler);
    EXPECT_NE(error.find(prefix + ".val.bin"), std::string::npos) << error;
    EXPECT_NE(error.find(std::strerror(EFBIG)), std::string::npos) << error;
  }
  EXPECT_EQ(files_of(out), before);
  // The same through the command line, under `ulimit -f 8` (KiB): exit 2 and one line.
  const test::RunResult r = test::run({"bash", "-c", "trap '' XFSZ; ulimit -f 8; exec \"$@\"", "bash", test::exe(),
                                       "prepare-data", "--input", new_in, "--output", prefix, "--split-on", "%",
                                       "--val-fraction", "0.9", "--seed", "1"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_EQ(r.err.rfind("fp8moe: error: " + prefix + ".val.bin", 0), 0u) << r.err;
  EXPECT_EQ(test::count(r.err, "\n"), 1u) << r.err;
  EXPECT_EQ(files_of(out), before);
  prepare_data({new_in}, prefix, 0.9, "%", 1);
  const auto after = files_of(out);
  ASSERT_EQ(after.size(), 4u);
  for (const auto& [name, bytes] : after) EXPECT_NE(bytes, before.at(name)) << name;
}

}  // namespace
}  // namespace fp8moe
