// Blends of many entries (data.path as Megatron's --data-path): each distinct pair of files mapped
// once however often the blend names it, the samples those entries give the same as each entry's
// data set opened alone, and the limits on entries and memory maps checked before any file is
// opened.
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "io/token_data.h"
#include "tests/test_util.h"

namespace fp8moe {
namespace {

// Lines of /proc/self/maps that map `path` (the kernel shows the file's resolved name).
size_t maps_of(const std::string& path) {
  const std::string name = " " + std::filesystem::canonical(path).string();
  std::ifstream in("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(in, line);)
    if (line.size() >= name.size() && line.compare(line.size() - name.size(), name.size(), name) == 0) ++n;
  return n;
}
size_t maps_in_use() {
  std::ifstream in("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// A byte-level data set of `bytes` random bytes (every window distinct), PREFIX.train.
std::string random_set(const test::TempDir& dir, const std::string& name, int bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string text;
  for (int i = 0; i < bytes; ++i) text += char(1 + rng() % 255);
  prepare_data({dir.write(name + ".txt", text)}, dir.path + "/" + name, 0.0, "", 1);
  return dir.path + "/" + name + ".train";
}

// The same data set under another name: PREFIX.idx and PREFIX.bin as symbolic links.
std::string alias(const std::string& prefix, const std::string& name) {
  for (const char* ext : {".idx", ".bin"}) std::filesystem::create_symlink(prefix + ext, name + ext);
  return name;
}

TEST(DataBlend, RepeatedEntriesMapEachFileOnce) {
  test::TempDir dir;
  const std::string a = random_set(dir, "a", 2000, 1);
  const std::string dotted = dir.path + "/./a.train", linked = alias(a, dir.path + "/link");
  // 3,000 entries of one data set under three spellings (the same files), weights 1, 2, 3 repeating.
  std::vector<DataSource> sources;
  for (int i = 0; i < 3000; ++i) sources.push_back({1.0 + i % 3, i % 3 == 0 ? a : i % 3 == 1 ? dotted : linked});
  const size_t maps_before = maps_in_use();
  DataBlend blend(sources, TokenCheck{256});
  const size_t maps_added = maps_in_use() - maps_before;
  std::printf("a blend of 3000 entries of one data set: %zu maps of its .bin, %zu of its .idx, %zu maps added\n",
              maps_of(a + ".bin"), maps_of(a + ".idx"), maps_added);
  EXPECT_EQ(maps_of(a + ".bin"), 1u);  // 3,000 each when every entry mapped its own
  EXPECT_EQ(maps_of(a + ".idx"), 1u);
  EXPECT_LE(maps_added, 2u);
  ASSERT_EQ(blend.sets().size(), 1u);  // the distinct data sets
  EXPECT_EQ(blend.entries(), 3000);
  // The shares are the entries': entry k is sampled in proportion to its own weight.
  std::vector<int64_t> taken(3, 0);
  for (int64_t i = 0; i < 6000; ++i) ++taken[size_t(blend.locate(i).first % 3)];
  EXPECT_EQ(taken, (std::vector<int64_t>{1000, 2000, 3000}));
}

// FNV-1a over the tokens and targets of samples [0, n).
uint64_t stream_digest(DataBlend& blend, uint64_t seed, int64_t n, int64_t T) {
  std::vector<int32_t> x(static_cast<size_t>(T)), y(static_cast<size_t>(T));
  uint64_t h = 0xcbf29ce484222325ull;
  for (int64_t i = 0; i < n; ++i) {
    blend.sample(seed, i, T, x.data(), y.data());
    for (int64_t t = 0; t < 2 * T; ++t) h = (h ^ uint32_t(t < T ? x[size_t(t)] : y[size_t(t - T)])) * 0x100000001b3ull;
  }
  return h;
}

// A blend that names data sets more than once samples as it did when every entry opened its own:
// entry k is its own member of the blend (its own share, its own count, its own window order from
// seed ^ (0x9E3779B97F4A7C15 x k), entry 0 the plain seed), whether or not it shares its files.
TEST(DataBlend, RepeatedEntriesSampleAsEachEntryAlone) {
  test::TempDir dir;
  const std::string a = random_set(dir, "a", 3000, 1), b = random_set(dir, "b", 2500, 2);
  const std::vector<DataSource> sources = {
      {0.3, a}, {0.2, b}, {0.25, dir.path + "/./a.train"}, {0.15, alias(a, dir.path + "/link")}, {0.1, b}};
  DataBlend blend(sources, TokenCheck{256});
  ASSERT_EQ(blend.sets().size(), 2u);
  std::vector<std::unique_ptr<IndexedDataset>> alone;  // each entry's data set opened by itself
  for (const DataSource& s : sources) alone.push_back(std::make_unique<IndexedDataset>(s.prefix, TokenCheck{256}));
  const int64_t T = 16, n = 400;
  const uint64_t seed = 42;
  std::vector<int64_t> taken(sources.size(), 0);
  std::vector<int32_t> x(T), y(T), wx(T), wy(T);
  for (int64_t i = 0; i < n; ++i) {
    size_t k = 0;  // the rule: the entry furthest behind its share, the first on ties
    double deficit = -1e300;
    for (size_t j = 0; j < sources.size(); ++j) {
      const double d = sources[j].weight * double(i + 1) - double(taken[j]);
      if (d > deficit) deficit = d, k = j;
    }
    const uint64_t entry_seed = k == 0 ? seed : seed ^ (0x9E3779B97F4A7C15ull * k);
    alone[k]->sample(entry_seed, taken[k]++, T, wx.data(), wy.data());
    blend.sample(seed, i, T, x.data(), y.data());
    ASSERT_EQ(x, wx) << "sample " << i << " (entry " << k << ")";
    ASSERT_EQ(y, wy) << "sample " << i;
  }
  // And bit for bit the stream of the code before files were shared (commit dc68bcd, where each
  // entry mapped its own files), over the same inputs.
  EXPECT_EQ(stream_digest(blend, seed, n, T), 0x608391773ee156b2ull);
}

TEST(DataBlend, EntriesAreLimitedUpFront) {
  test::TempDir dir;
  // Refused before any file is opened (none of these exists): the count and the limit named.
  const std::vector<DataSource> too_many(size_t(kMaxBlendEntries) + 1, DataSource{1.0, dir.path + "/missing"});
  try {
    DataBlend blend(too_many, TokenCheck{});
    ADD_FAILURE() << "a blend of " << too_many.size() << " entries was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("65537 entries, more than the 65536 a blend may have"), std::string::npos)
        << e.what();
  }
}

// Each distinct data set takes kMapsPerDataSet memory maps; a blend may take half of what the
// process has left of vm.max_map_count.
TEST(DataBlend, MapBudgetFollowsTheMapCount) {
  EXPECT_NO_THROW(check_map_budget(16132, 65530, 1000));  // (65530 - 1000) / 2 / 2
  try {
    check_map_budget(16133, 65530, 1000);
    ADD_FAILURE() << "16133 data sets fit";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("16133 distinct data sets need 32266 memory maps"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("vm.max_map_count 65530"), std::string::npos) << e.what();
  }
  EXPECT_THROW(check_map_budget(1, 65530, 65530), DataError);
}

// The same check in a blend's construction, against this process's maps: most of vm.max_map_count
// taken by anonymous pages of alternating protection (each its own map), then a blend of more
// distinct data sets than half of the rest allows is refused before any is opened.
TEST(DataBlend, DistinctDataSetsAreLimitedByTheMapsLeft) {
  std::ifstream in("/proc/sys/vm/max_map_count");
  int64_t max_maps = 0;
  if (!(in >> max_maps)) GTEST_SKIP() << "no /proc/sys/vm/max_map_count: no map budget to check";
  if (max_maps > 300000) GTEST_SKIP() << "vm.max_map_count " << max_maps << ": too many maps to fill in a test";
  test::TempDir dir;
  std::vector<DataSource> sources;
  for (int k = 0; k < 12; ++k) sources.push_back({1.0, random_set(dir, std::string(1, char('a' + k)), 40, uint32_t(k))});
  // Leave 40 maps free: room for 10 data sets (40 / 2 / 2), not for 12.
  const int64_t fill = max_maps - int64_t(maps_in_use()) - 40;
  ASSERT_GT(fill, 0);
  const long page = sysconf(_SC_PAGESIZE);
  void* region = mmap(nullptr, size_t(fill) * size_t(page), PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(region, MAP_FAILED);
  for (int64_t p = 1; p < fill; p += 2) mprotect(static_cast<char*>(region) + p * page, size_t(page), PROT_NONE);
  std::string error;
  try {
    DataBlend blend(sources, TokenCheck{256});
  } catch (const DataError& e) {
    error = e.what();
  }
  const bool opened_none = maps_of(sources[0].prefix + ".bin") == 0;
  munmap(region, size_t(fill) * size_t(page));
  EXPECT_NE(error.find("12 distinct data sets need 24 memory maps"), std::string::npos) << error;
  EXPECT_NE(error.find("vm.max_map_count " + std::to_string(max_maps)), std::string::npos) << error;
  EXPECT_TRUE(opened_none);
  EXPECT_NO_THROW(DataBlend(sources, TokenCheck{256}));  // with the maps given back
}

}  // namespace
}  // namespace fp8moe
