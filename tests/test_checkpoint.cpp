// Checkpoint: one safetensors file or a sharded Hugging Face checkpoint (folder / index), shards
// opened lazily, and the index read at the standard of the safetensors reader under hostile input.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_test_util.h"
#include "error_test_util.h"
#include "latentmoe/checkpoint.h"
#include "latentmoe/error.h"
#include "latentmoe/random.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;
using testing::expect_error;
using testing::shard_file_name;
using testing::write_index;
using testing::write_sharded_checkpoint;

// A tensor of `dtype` and `shape` whose bytes are a fixed-seed pseudo-random sequence.
HostTensor patterned_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed) {
  HostTensor tensor(dtype, std::move(shape));
  SplitMix64 random(seed);
  auto* bytes = static_cast<unsigned char*>(tensor.data());
  for (size_t i = 0; i < tensor.nbytes(); ++i) bytes[i] = static_cast<unsigned char>(random.next() >> 56);
  return tensor;
}

std::string bytes_of(const HostTensor& tensor) {
  return std::string(static_cast<const char*>(tensor.data()), tensor.nbytes());
}

void write_text(const fs::path& path, const std::string& text) {
  std::error_code ignored;
  fs::remove(path, ignored);
  std::ofstream out(path, std::ios::binary);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

class CheckpointTest : public ::testing::Test {
 protected:
  CheckpointTest() {
    const std::vector<std::pair<DType, std::vector<int64_t>>> kinds = {
        {DType::f32, {3, 5}}, {DType::bf16, {4}}, {DType::f16, {2, 3, 2}}, {DType::u8, {7}}, {DType::i64, {2, 2}}};
    uint64_t seed = 100;
    for (int layer = 0; layer < 3; ++layer) {
      for (const char* name : {"a.weight", "b.weight", "c.bias", "d"}) {
        const auto& [dtype, shape] = kinds[seed % kinds.size()];
        tensors.emplace_back("model.layers." + std::to_string(layer) + ".mlp." + name,
                             patterned_tensor(dtype, shape, seed));
        ++seed;
      }
    }
    tensors.emplace_back("lm_head.weight", patterned_tensor(DType::f32, {6, 2}, seed));
  }

  fs::path folder() const { return dir / "ckpt"; }
  std::string index() const { return (folder() / "model.safetensors.index.json").string(); }
  // The three-shard checkpoint of `tensors` (tensor i in shard i % 3).
  std::string write_checkpoint() { return write_sharded_checkpoint(folder(), tensors, 3); }
  std::string shard(int i) const { return (folder() / shard_file_name(i, 3)).string(); }

  // The tensors every test expects, their bytes compared exactly.
  void expect_all_tensors(const Checkpoint& checkpoint) {
    ASSERT_EQ(checkpoint.size(), tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& [name, tensor] = tensors[i];
      SCOPED_TRACE(name);
      EXPECT_TRUE(checkpoint.contains(name));
      EXPECT_EQ(checkpoint.shard_of(name), shard_file_name(static_cast<int>(i % 3), 3));
      const std::optional<CheckpointTensor> found = checkpoint.tensor(name);
      ASSERT_TRUE(found.has_value());
      EXPECT_EQ(found->entry->dtype, tensor.dtype());
      EXPECT_EQ(found->entry->shape, tensor.shape());
      EXPECT_EQ(found->path(), shard(static_cast<int>(i % 3)));
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(found->bytes()), tensor.nbytes()), bytes_of(tensor));
      // The SafetensorsFile-shaped calls the loader uses.
      const SafetensorsEntry* entry = checkpoint.find(name);
      ASSERT_EQ(entry, found->entry);
      EXPECT_EQ(checkpoint.bytes(*entry), found->bytes());
      EXPECT_EQ(checkpoint.file_path(*entry), shard(static_cast<int>(i % 3)));
      EXPECT_EQ(bytes_of(checkpoint.read(name)), bytes_of(tensor));
    }
    EXPECT_EQ(checkpoint.find("model.layers.0.mlp.nothing"), nullptr);
    EXPECT_FALSE(checkpoint.tensor("").has_value());
  }

  // Checkpoint::open(path) throws an Error containing every fragment.
  static void expect_open_error(const std::string& path, const std::vector<std::string>& fragments) {
    expect_error([&] { Checkpoint::open(path); }, fragments);
  }

  testing::ScratchDir scratch{"checkpoint"};
  const fs::path& dir = scratch.path();
  std::vector<std::pair<std::string, HostTensor>> tensors;
};

TEST_F(CheckpointTest, three_shards_opened_by_folder_and_by_index) {
  write_checkpoint();
  for (const std::string& path : {folder().string(), folder().string() + "/", index()}) {
    SCOPED_TRACE(path);
    const Checkpoint checkpoint = Checkpoint::open(path);
    EXPECT_TRUE(checkpoint.is_sharded());
    EXPECT_EQ(checkpoint.single_file(), nullptr);
    EXPECT_EQ(fs::path(checkpoint.index_path()), fs::path(index()).lexically_normal());
    EXPECT_EQ(checkpoint.path(), checkpoint.index_path());
    EXPECT_EQ(checkpoint.open_shard_count(), 0u);
    EXPECT_EQ(checkpoint.shard_names(),
              (std::vector<std::string>{shard_file_name(0, 3), shard_file_name(1, 3), shard_file_name(2, 3)}));
    EXPECT_EQ(checkpoint.tensor_count_in_shard(shard_file_name(0, 3)), 5u);
    EXPECT_EQ(checkpoint.tensor_count_in_shard(shard_file_name(1, 3)), 4u);
    EXPECT_EQ(checkpoint.tensor_count_in_shard("other.safetensors"), 0u);
    uint64_t total_size = 0;
    for (const auto& [name, tensor] : tensors) total_size += tensor.nbytes();
    EXPECT_EQ(checkpoint.metadata().at("total_size"), std::to_string(total_size));
    EXPECT_EQ(checkpoint.names("model.layers.1."),
              (std::vector<std::string>{"model.layers.1.mlp.a.weight", "model.layers.1.mlp.b.weight",
                                        "model.layers.1.mlp.c.bias", "model.layers.1.mlp.d"}));
    EXPECT_EQ(checkpoint.names("model.layers.9").size(), 0u);
    EXPECT_EQ(checkpoint.names().size(), tensors.size());
    EXPECT_EQ(checkpoint.open_shard_count(), 0u) << "listing names must not open shards";
    expect_all_tensors(checkpoint);
    EXPECT_EQ(checkpoint.open_shard_count(), 3u);
    checkpoint.verify();
  }
}

TEST_F(CheckpointTest, relative_index_path_and_shards_in_a_subfolder) {
  // Shards may sit in a subfolder of the index's folder; a relative index path resolves from the
  // working directory.
  fs::create_directories(folder() / "shards");
  write_safetensors((folder() / "shards" / "one.safetensors").string(), {{"x", tensors[0].second.view()}});
  write_index(folder() / "model.safetensors.index.json", {{"x", "shards/one.safetensors"}});
  const fs::path old_cwd = fs::current_path();
  fs::current_path(folder());
  try {
    const Checkpoint checkpoint = Checkpoint::open("model.safetensors.index.json");
    EXPECT_EQ(bytes_of(checkpoint.read("x")), bytes_of(tensors[0].second));
    EXPECT_EQ(checkpoint.file_path(checkpoint.at("x")), "shards/one.safetensors");
  } catch (...) {
    fs::current_path(old_cwd);
    throw;
  }
  fs::current_path(old_cwd);
}

TEST_F(CheckpointTest, shards_are_opened_only_when_a_tensor_they_hold_is_needed) {
  write_checkpoint();
  // Shard 3 becomes garbage and shard 2 a FIFO: neither may be touched by look-ups in shard 1.
  write_text(shard(2), "this is not a safetensors file");
  fs::remove(shard(1));
  ASSERT_EQ(::mkfifo(shard(1).c_str(), 0600), 0) << std::strerror(errno);

  const Checkpoint checkpoint = Checkpoint::open(folder().string());
  EXPECT_EQ(checkpoint.names().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); i += 3) {
    EXPECT_EQ(bytes_of(checkpoint.read(tensors[i].first)), bytes_of(tensors[i].second));
  }
  EXPECT_EQ(checkpoint.open_shard_count(), 1u);

  // Asking for a tensor of a bad shard names the index, the shard and the problem.
  expect_error([&] { checkpoint.find(tensors[2].first); },
               {index() + ": shard \"" + shard_file_name(2, 3) + "\" (holding tensor \"" + tensors[2].first + "\"): ",
                shard(2) + ": "});
  expect_error([&] { checkpoint.find(tensors[1].first); },
               {index() + ": shard \"" + shard_file_name(1, 3) + "\"", "not a regular file"});
  expect_error([&] { checkpoint.verify(); }, {index() + ": shard \""});
  // The good shard still serves, and a failed shard is tried again (not cached as a failure).
  EXPECT_NE(checkpoint.find(tensors[3].first), nullptr);
  fs::remove(shard(1));
  write_sharded_checkpoint(dir / "fresh", tensors, 3);
  fs::copy_file(dir / "fresh" / shard_file_name(1, 3), shard(1));
  EXPECT_EQ(bytes_of(checkpoint.read(tensors[1].first)), bytes_of(tensors[1].second));
  EXPECT_EQ(checkpoint.open_shard_count(), 2u);
}

TEST_F(CheckpointTest, missing_shard_is_an_error_only_when_needed) {
  write_checkpoint();
  fs::remove(shard(1));
  const Checkpoint checkpoint = Checkpoint::open(index());
  EXPECT_NE(checkpoint.find(tensors[0].first), nullptr);
  expect_error([&] { checkpoint.at(tensors[1].first); },
               {index() + ": shard \"" + shard_file_name(1, 3) + "\"", "No such file or directory"});
  expect_error([&] { checkpoint.verify(); }, {shard_file_name(1, 3)});
}

TEST_F(CheckpointTest, only_the_weight_map_counts) {
  // "x" is in both shards with different bytes; the map sends it to b. "stray" is in a but not
  // in the map; "ghost" is in the map but not in its shard.
  const HostTensor x_in_a = patterned_tensor(DType::f32, {4}, 1), x_in_b = patterned_tensor(DType::f32, {4}, 2);
  const HostTensor stray = patterned_tensor(DType::u8, {3}, 3);
  fs::create_directories(folder());
  write_safetensors((folder() / "a.safetensors").string(), {{"x", x_in_a.view()}, {"stray", stray.view()}});
  write_safetensors((folder() / "b.safetensors").string(), {{"x", x_in_b.view()}});
  write_index(index(), {{"x", "b.safetensors"}, {"ghost", "a.safetensors"}});

  const Checkpoint checkpoint = Checkpoint::open(folder().string());
  EXPECT_EQ(bytes_of(checkpoint.read("x")), bytes_of(x_in_b));
  EXPECT_EQ(checkpoint.find("stray"), nullptr);
  EXPECT_FALSE(checkpoint.contains("stray"));
  EXPECT_EQ(checkpoint.open_shard_count(), 1u);
  expect_error([&] { checkpoint.find("ghost"); },
               {index() + ": tensor \"ghost\" is mapped to shard \"a.safetensors\", which has no tensor of that name"});
  expect_error([&] { checkpoint.verify(); }, {"tensor \"ghost\" is mapped to shard \"a.safetensors\""});

  // An entry of another file is refused by bytes(), not read at its foreign offsets.
  const SafetensorsFile a = SafetensorsFile::open((folder() / "a.safetensors").string());
  expect_error([&] { checkpoint.bytes(a.at("x")); }, {"tensor \"x\" is not an entry of this checkpoint"});
}

TEST_F(CheckpointTest, wraps_an_opened_file_owned_or_borrowed) {
  const std::string path = (dir / "one.safetensors").string();
  write_safetensors(path, {{"p", tensors[0].second.view()}, {"q", tensors[1].second.view()}}, {{"format", "pt"}});
  SafetensorsFile file = SafetensorsFile::open(path);
  {
    const Checkpoint borrowed = Checkpoint::view(file);
    EXPECT_FALSE(borrowed.is_sharded());
    EXPECT_EQ(borrowed.single_file(), &file);
    EXPECT_EQ(borrowed.path(), path);
    EXPECT_EQ(borrowed.index_path(), "");
    EXPECT_EQ(borrowed.find("p"), file.find("p"));
    EXPECT_EQ(borrowed.bytes(*file.find("q")), file.bytes(*file.find("q")));
    EXPECT_EQ(borrowed.file_path(*file.find("q")), path);
    EXPECT_EQ(borrowed.names(), (std::vector<std::string>{"p", "q"}));
    EXPECT_EQ(borrowed.shard_names(), std::vector<std::string>{path});
    EXPECT_EQ(borrowed.shard_of("q"), path);
    EXPECT_EQ(borrowed.metadata().at("format"), "pt");
    expect_error([&] { borrowed.at("r"); }, {path + ": no tensor named r"});
  }
  Checkpoint owned(std::move(file));
  const Checkpoint moved = std::move(owned);
  EXPECT_EQ(bytes_of(moved.read("q")), bytes_of(tensors[1].second));
  EXPECT_EQ(moved.size(), 2u);

  // open() on a file or on a folder holding exactly one (dot-files ignored) gives the same.
  for (const std::string& where : {path, dir.string()}) {
    const Checkpoint opened = Checkpoint::open(where);
    EXPECT_FALSE(opened.is_sharded());
    ASSERT_NE(opened.single_file(), nullptr);
    EXPECT_EQ(opened.single_file()->path(), (fs::path(dir) / "one.safetensors").string());
    EXPECT_EQ(bytes_of(opened.read("p")), bytes_of(tensors[0].second));
  }
  write_text(dir / ".hidden.safetensors", "ignored");
  EXPECT_FALSE(Checkpoint::open(dir.string()).is_sharded());
}

TEST_F(CheckpointTest, folder_without_index_needs_exactly_one_safetensors_file) {
  fs::create_directories(folder());
  expect_open_error(folder().string(),
                    {folder().string() + ": no model.safetensors.index.json and no .safetensors file"});
  write_safetensors((folder() / "b.safetensors").string(), {{"x", tensors[0].second.view()}});
  write_safetensors((folder() / "a.safetensors").string(), {{"x", tensors[0].second.view()}});
  expect_open_error(folder().string(),
                    {folder().string() + ": no model.safetensors.index.json and 2 .safetensors files (a.safetensors, "
                                         "b.safetensors); name one file or the index"});
  expect_open_error((dir / "nothing_here").string(), {"nothing_here: cannot open: No such file or directory"});
}

TEST_F(CheckpointTest, index_that_is_not_a_regular_file_is_refused_without_blocking) {
  fs::create_directories(folder());
  ASSERT_EQ(::mkfifo(index().c_str(), 0600), 0) << std::strerror(errno);
  expect_open_error(folder().string(), {index() + ": cannot read index: not a regular file"});
  expect_open_error(index(), {index() + ": cannot read index: not a regular file"});
  fs::remove(index());
  fs::create_directories(index());  // a directory named like the index
  expect_open_error(folder().string(), {index() + ": cannot read index: is a directory, not a regular file"});
  // A dangling symlink as the index is an error naming it, even beside a single safetensors file.
  fs::remove(index());
  write_safetensors((folder() / "only.safetensors").string(), {{"x", tensors[0].second.view()}});
  fs::create_symlink(folder() / "blobs" / "gone", index());
  expect_open_error(folder().string(), {index() + ": cannot read index: No such file or directory"});
  // A safetensors path that is a FIFO is refused the same way.
  ASSERT_EQ(::mkfifo((dir / "w.safetensors").c_str(), 0600), 0);
  expect_open_error((dir / "w.safetensors").string(), {"w.safetensors: not a regular file"});
}

TEST_F(CheckpointTest, index_over_the_size_limit_is_refused_before_reading) {
  const fs::path big = dir / "big.index.json";
  { std::ofstream create(big); }
  // Sparse: costs no disk, and the size is refused from stat before a byte is read.
  fs::resize_file(big, kMaxCheckpointIndexBytes + 1);
  expect_open_error(big.string(), {big.string() + ": index is over the limit of 67108864 bytes (64 MiB)"});
  fs::resize_file(big, kMaxCheckpointIndexBytes);  // at the limit: read, then refused as JSON (NULs)
  expect_open_error(big.string(), {big.string() + ": index is not valid JSON: NUL byte at offset 0"});
}

TEST_F(CheckpointTest, hostile_index_json_is_one_error_naming_the_index) {
  fs::create_directories(folder());
  write_safetensors((folder() / "s.safetensors").string(), {{"x", tensors[0].second.view()}});
  const std::string path = index();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"weight_map": {"x": "s.safetensors", "y": "s.safetensors", "x": "s.safetensors"}})",
       "weight_map lists tensor \"x\" twice"},
      {R"({"weight_map": {"x": "s.safetensors"}, "weight_map": {}})", "duplicate key \"weight_map\""},
      {R"({"metadata": {"a": 1, "a": 2}, "weight_map": {}})", "duplicate key \"a\" in metadata"},
      {R"({"weight_map": {"x": 3}})", "weight_map value of \"x\" is not a string (a shard file name)"},
      {R"({"weight_map": {"x": null}})", "weight_map value of \"x\" is not a string"},
      {R"({"weight_map": {"x": true}})", "weight_map value of \"x\" is not a string"},
      {R"({"weight_map": {"x": ["s.safetensors"]}})", "weight_map value of \"x\" is not a string"},
      {R"({"weight_map": {"x": {"file": "s.safetensors"}}})", "weight_map value of \"x\" is not a string"},
      {R"({"weight_map": ["x", "s.safetensors"]})", "weight_map is not a JSON object"},
      {R"({"weight_map": "s.safetensors"})", "weight_map is not a JSON object"},
      {R"({"metadata": 5, "weight_map": {}})", "metadata is not a JSON object"},
      {R"(["weight_map"])", "index is not a JSON object"},
      {R"("weight_map")", "index is not a JSON object"},
      {R"({"metadata": {}})", "index has no \"weight_map\""},
      {R"({"metadata": {"a": [[1]]}, "weight_map": {}})", "index is nested more than 3 levels deep (an index needs 2)"},
      {"{\"weight_map\": {\"x\": \"s.safetensors\"}", "index is not valid JSON"},
      {"", "index is not valid JSON"},
      {std::string("{\"weight_map\": {}}\0", 19), "index is not valid JSON: NUL byte at offset 18"},
      {"{\"weight_map\": {\"x\": \"s\xff.safetensors\"}}", "index is not valid JSON"},
  };
  for (const auto& [text, message] : cases) {
    SCOPED_TRACE(text);
    write_text(path, text);
    expect_open_error(path, {path + ": " + message});
    expect_open_error(folder().string(), {path + ": " + message});
  }
  // Accepted: unknown top-level keys (any shape within the depth), metadata lists and scalars.
  write_text(path, R"({"format": [1, {"a": 2}], "metadata": {"total_size": 12, "tags": ["a", "b"], "ok": true,
                      "f": 1.50}, "weight_map": {"x": "s.safetensors"}})");
  const Checkpoint checkpoint = Checkpoint::open(path);
  EXPECT_EQ(checkpoint.metadata(),
            (std::map<std::string, std::string>{{"total_size", "12"}, {"ok", "true"}, {"f", "1.50"}}));
  EXPECT_EQ(bytes_of(checkpoint.read("x")), bytes_of(tensors[0].second));
  // An empty weight_map is a valid, empty checkpoint.
  write_text(path, R"({"weight_map": {}})");
  EXPECT_EQ(Checkpoint::open(path).size(), 0u);
}

TEST_F(CheckpointTest, deep_nesting_is_refused_before_it_is_read) {
  // A million open brackets: refused at the fourth level, without recursion or memory growth.
  fs::create_directories(folder());
  for (const std::string& start : {std::string("{\"metadata\": {\"a\": "), std::string("{\"x\": "), std::string()}) {
    std::string text = start + std::string(1'000'000, '[');
    write_text(index(), text);
    expect_open_error(index(), {index() + ": "});
  }
  write_text(index(), "{\"x\": " + std::string(1'000'000, '['));
  expect_open_error(index(), {"index is nested more than 3 levels deep"});
}

TEST_F(CheckpointTest, shard_names_must_stay_inside_the_folder) {
  fs::create_directories(folder() / "sub");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/etc/passwd", "is an absolute path"},
      {"../outside.safetensors", "has a \"..\" component"},
      {"sub/../../outside.safetensors", "has a \"..\" component"},
      {"..", "has a \"..\" component"},
      {"", "is empty"},
      {"sub//x.safetensors", "has an empty path component"},
      {"sub/", "has an empty path component"},
      {"./x.safetensors", "has a \".\" component"},
      {std::string("x.safetensors\0/etc/passwd", 25), "contains a NUL byte"},
  };
  for (const auto& [name, problem] : cases) {
    SCOPED_TRACE(name);
    write_index(index(), {{"good", "sub/ok.safetensors"}, {"t", name}});
    expect_open_error(index(), {index() + ": weight_map value of \"t\": shard name \"", "\" " + problem,
                                "shard names must be relative paths that stay inside the checkpoint folder"});
  }
  // A shard that is a FIFO inside the folder: the index is fine, the look-up is refused at once.
  ASSERT_EQ(::mkfifo((folder() / "sub" / "pipe.safetensors").c_str(), 0600), 0);
  write_index(index(), {{"t", "sub/pipe.safetensors"}});
  const Checkpoint checkpoint = Checkpoint::open(index());
  expect_error([&] { checkpoint.find("t"); }, {"sub/pipe.safetensors: not a regular file"});
  // A device is refused the same way (a symlink inside the folder is followed, then checked).
  fs::create_symlink("/dev/zero", folder() / "sub" / "zero.safetensors");
  write_index(index(), {{"t", "sub/zero.safetensors"}});
  expect_error([&] { Checkpoint::open(index()).find("t"); }, {"sub/zero.safetensors: not a regular file"});
}

TEST_F(CheckpointTest, error_text_stays_one_line) {
  // A tensor name with a newline and an escape sequence, mapped to a missing shard.
  fs::create_directories(folder());
  write_index(index(), {{"evil\n\x1b[31mname", "missing.safetensors"}});
  const Checkpoint checkpoint = Checkpoint::open(index());
  try {
    checkpoint.find("evil\n\x1b[31mname");
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    const std::string text = error.what();
    EXPECT_EQ(text.find('\n'), std::string::npos) << text;
    EXPECT_EQ(text.find('\x1b'), std::string::npos) << text;
    EXPECT_NE(text.find("evil\\n\\x1b[31mname"), std::string::npos) << text;
  }
}

TEST_F(CheckpointTest, concurrent_look_ups_share_one_opening_per_shard) {
  write_checkpoint();
  const Checkpoint checkpoint = Checkpoint::open(folder().string());
  std::vector<const SafetensorsEntry*> seen(8 * tensors.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < tensors.size(); ++i) {
        const size_t k = (i + static_cast<size_t>(t)) % tensors.size();
        seen[t * tensors.size() + k] = checkpoint.find(tensors[k].first);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 1; t < 8; ++t) {
    for (size_t k = 0; k < tensors.size(); ++k) EXPECT_EQ(seen[t * tensors.size() + k], seen[k]);
  }
  EXPECT_EQ(checkpoint.open_shard_count(), 3u);
}

TEST_F(CheckpointTest, an_index_of_100k_tensors_is_read_in_one_pass) {
  // Speed is documented (docs/FILES.md), not asserted; this runs the size.
  constexpr int kCount = 100'000;
  fs::create_directories(folder());
  std::string text = R"({"metadata": {"total_size": 123}, "weight_map": {)";
  text.reserve(size_t{kCount} * 80);
  for (int i = kCount - 1; i >= 0; --i) {  // reverse order: the reader has to sort
    text += (i == kCount - 1 ? "\"" : ",\n\"") + std::string("model.layers.") + std::to_string(i / 1000) +
            ".mlp.experts." + std::to_string(i % 1000) + ".weight\": \"" + shard_file_name(i % 37, 37) + "\"";
  }
  write_text(index(), text + "}}");
  const Checkpoint checkpoint = Checkpoint::open(index());
  EXPECT_EQ(checkpoint.size(), size_t{kCount});
  EXPECT_EQ(checkpoint.shard_names().size(), 37u);
  EXPECT_EQ(checkpoint.names("model.layers.42.").size(), 1000u);
  EXPECT_EQ(checkpoint.shard_of("model.layers.77.mlp.experts.777.weight"), shard_file_name(77777 % 37, 37));
  EXPECT_EQ(checkpoint.open_shard_count(), 0u);

  // A duplicate among them is still found.
  write_text(index(), text + ",\"model.layers.5.mlp.experts.5.weight\": \"x.safetensors\"}}");
  expect_open_error(index(), {"weight_map lists tensor \"model.layers.5.mlp.experts.5.weight\" twice"});
}

}  // namespace
}  // namespace latentmoe
