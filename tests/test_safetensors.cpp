#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "latentmoe/error.h"
#include "latentmoe/safetensors.h"
#include "scratch_dir.h"

namespace latentmoe {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return scratch_.file(name); }
  testing::ScratchDir scratch_{"safetensors"};
  const fs::path& dir_ = scratch_.path();
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const std::string& path, const std::string& bytes) {
  // A new file each time: truncating a file in place makes ext4 flush it on close (slow in loops).
  std::error_code ignored;
  fs::remove(path, ignored);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(value >> (8 * i));
  return bytes;
}

// A hand-made file: length prefix (the header's size unless overridden), header, data.
std::string raw_file(const std::string& header, const std::string& data = "",
                     std::optional<uint64_t> length = std::nullopt) {
  return le64(length.value_or(header.size())) + header + data;
}

// Opening `bytes` must throw an Error whose message names the file and contains `expected`.
void expect_rejected(const std::string& path, const std::string& bytes, const std::string& expected) {
  write_all(path, bytes);
  try {
    SafetensorsFile file = SafetensorsFile::open(path);
    ADD_FAILURE() << "opened a bad file; expected an error containing \"" << expected << "\"";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << "expected \"" << expected << "\" in: " << message;
  }
}

std::vector<std::string> directory_listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& item : fs::directory_iterator(dir)) names.push_back(item.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(SafetensorsTest, round_trip_dtypes_shapes_and_metadata) {
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f};
  std::vector<uint16_t> b = {0x3f80, 0xc000, 0x7fc0, 0x0001};
  std::vector<int64_t> c = {-1, 0, 1, int64_t{1} << 62};
  std::vector<uint8_t> d = {0, 255, 7, 128, 9};
  std::vector<double> f = {3.141592653589793};
  std::vector<std::pair<std::string, TensorView>> tensors = {
      {"a", TensorView(a.data(), DType::f32, {2, 3})},    {"b.bf16", TensorView(b.data(), DType::bf16, {4})},
      {"c", TensorView(c.data(), DType::i64, {1, 2, 2})}, {"empty", TensorView(nullptr, DType::f16, {0, 3})},
      {"d", TensorView(d.data(), DType::u8, {5})},        {"f", TensorView(f.data(), DType::f64, {1, 1, 1, 1})},
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "hello \"world\""}};
  const std::string file_path = path("round_trip.safetensors");
  write_safetensors(file_path, tensors, metadata);

  // Byte layout: the length, a space-padded header of a multiple of 8 bytes, data in the order given.
  const std::string raw = read_all(file_path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<unsigned char>(raw[i]);
  EXPECT_EQ(header_size % 8, 0u);
  const std::string header = raw.substr(8, header_size);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  std::string expected_data;
  auto append = [&](const void* data, size_t size) { expected_data.append(static_cast<const char*>(data), size); };
  append(a.data(), 24);
  append(b.data(), 8);
  append(c.data(), 32);
  append(d.data(), 5);
  append(f.data(), 8);
  EXPECT_EQ(raw.size(), 8 + header_size + expected_data.size());
  EXPECT_EQ(raw.substr(8 + header_size), expected_data);

  SafetensorsFile file = SafetensorsFile::open(file_path);
  EXPECT_EQ(file.path(), file_path);
  EXPECT_EQ(file.metadata(), metadata);
  ASSERT_EQ(file.entries().size(), 6u);
  // Offset order; "empty" (0 bytes at offset 64) sorts before "d", which starts at the same offset.
  std::vector<std::string> order;
  for (const auto& entry : file.entries()) order.push_back(entry.name);
  EXPECT_EQ(order, (std::vector<std::string>{"a", "b.bf16", "c", "empty", "d", "f"}));

  const SafetensorsEntry& entry_c = file.at("c");
  EXPECT_EQ(entry_c.dtype, DType::i64);
  EXPECT_EQ(entry_c.shape, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(entry_c.begin, 32u);
  EXPECT_EQ(entry_c.end, 64u);
  EXPECT_EQ(std::memcmp(file.bytes(entry_c), c.data(), 32), 0);

  HostTensor read_a = file.read("a");
  EXPECT_EQ(read_a.dtype(), DType::f32);
  EXPECT_EQ(read_a.shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(read_a.data(), a.data(), 24), 0);  // bit-exact, -0.0 included
  EXPECT_EQ(reinterpret_cast<uintptr_t>(read_a.data()) % 64, 0u);
  HostTensor read_b = file.read("b.bf16");
  EXPECT_EQ(read_b.dtype(), DType::bf16);
  EXPECT_EQ(std::memcmp(read_b.data(), b.data(), 8), 0);
  HostTensor read_empty = file.read("empty");
  EXPECT_EQ(read_empty.dtype(), DType::f16);
  EXPECT_EQ(read_empty.shape(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(read_empty.numel(), 0);
  HostTensor read_d = file.read("d");
  EXPECT_EQ(std::memcmp(read_d.data(), d.data(), 5), 0);
  HostTensor read_f = file.read("f");
  EXPECT_EQ(read_f.data_as<double>()[0], f[0]);

  EXPECT_EQ(file.find("missing"), nullptr);
  EXPECT_NE(file.find("a"), nullptr);
  try {
    file.at("missing");
    ADD_FAILURE() << "at() of a missing tensor did not throw";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("no tensor named missing"), std::string::npos) << error.what();
  }
  EXPECT_THROW(file.read("missing"), Error);
}

TEST_F(SafetensorsTest, header_padding_for_every_remainder) {
  // Names of growing length move the header size through all eight remainders mod 8.
  float value = 1.0f;
  for (int length = 1; length <= 8; ++length) {
    const std::string file_path = path("pad" + std::to_string(length) + ".safetensors");
    write_safetensors(file_path, {{std::string(length, 'x'), TensorView(&value, DType::f32, {1})}});
    const std::string raw = read_all(file_path);
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<unsigned char>(raw[i]);
    EXPECT_EQ(header_size % 8, 0u) << length;
    EXPECT_EQ(raw.size(), 8 + header_size + 4);
    SafetensorsFile file = SafetensorsFile::open(file_path);
    EXPECT_EQ(file.read(std::string(length, 'x')).data_as<float>()[0], 1.0f);
  }
}

TEST_F(SafetensorsTest, strided_view_is_written_contiguously) {
  float matrix[12];
  for (int i = 0; i < 12; ++i) matrix[i] = static_cast<float>(i);
  TensorView full(matrix, DType::f32, {3, 4});
  const std::string file_path = path("strided.safetensors");
  write_safetensors(file_path, {{"cols", full.slice_cols(1, 3)}, {"rows", full.slice_rows(1, 2)}});
  SafetensorsFile file = SafetensorsFile::open(file_path);
  HostTensor cols = file.read("cols");
  ASSERT_EQ(cols.shape(), (std::vector<int64_t>{3, 2}));
  const float expected_cols[6] = {1, 2, 5, 6, 9, 10};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(cols.data_as<float>()[i], expected_cols[i]) << i;
  HostTensor rows = file.read("rows");
  ASSERT_EQ(rows.shape(), (std::vector<int64_t>{1, 4}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(rows.data_as<float>()[i], 4.0f + i);
}

TEST_F(SafetensorsTest, scalar_and_empty_files) {
  // A 0-d tensor (shape []) reads as a HostTensor of shape [] holding one element.
  const std::string scalar_header = R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})";
  float value = 2.5f;
  write_all(path("scalar.safetensors"), raw_file(scalar_header, std::string(reinterpret_cast<char*>(&value), 4)));
  SafetensorsFile scalar = SafetensorsFile::open(path("scalar.safetensors"));
  HostTensor s = scalar.read("s");
  EXPECT_TRUE(s.shape().empty());
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.nbytes(), 4u);
  EXPECT_EQ(s.data_as<float>()[0], 2.5f);

  // No tensors at all, and no data section.
  write_all(path("none.safetensors"), raw_file("{}      "));
  SafetensorsFile none = SafetensorsFile::open(path("none.safetensors"));
  EXPECT_TRUE(none.entries().empty());
  EXPECT_TRUE(none.metadata().empty());
  write_safetensors(path("written_none.safetensors"), {});
  EXPECT_TRUE(SafetensorsFile::open(path("written_none.safetensors")).entries().empty());
  EXPECT_EQ(read_all(path("written_none.safetensors")).size(), 16u);  // 8 + "{}" padded to 8
}

TEST_F(SafetensorsTest, moves_keep_the_mapping) {
  float values[2] = {4.0f, 5.0f};
  write_safetensors(path("m.safetensors"), {{"v", TensorView(values, DType::f32, {2})}});
  SafetensorsFile first = SafetensorsFile::open(path("m.safetensors"));
  SafetensorsFile second(std::move(first));
  EXPECT_EQ(second.read("v").data_as<float>()[1], 5.0f);
  write_safetensors(path("n.safetensors"), {{"w", TensorView(values, DType::f32, {1})}});
  SafetensorsFile third = SafetensorsFile::open(path("n.safetensors"));
  third = std::move(second);
  EXPECT_EQ(third.path(), path("m.safetensors"));
  EXPECT_EQ(third.read("v").data_as<float>()[0], 4.0f);
  EXPECT_EQ(third.find("w"), nullptr);
}

TEST_F(SafetensorsTest, rejects_short_and_oversized_headers) {
  expect_rejected(path("empty.st"), "", "shorter than the 8-byte header length");
  expect_rejected(path("five.st"), "abcde", "shorter than the 8-byte header length");
  expect_rejected(path("past.st"), raw_file("{}", "", 1000), "runs past the end");
  expect_rejected(path("huge.st"), raw_file("{}", "", uint64_t{1} << 63), "exceeds the limit");
  expect_rejected(path("over100mb.st"), raw_file("{}", "", 100'000'001), "exceeds the limit");
  expect_rejected(path("max.st"), raw_file("{}", "", ~uint64_t{0}), "exceeds the limit");
}

TEST_F(SafetensorsTest, rejects_bad_json_structure) {
  expect_rejected(path("json.st"), raw_file(R"({"a": )"), "not valid JSON");
  expect_rejected(path("nul.st"), raw_file(std::string("{}\0\0", 4)), "NUL byte at header offset 2");
  expect_rejected(path("utf8.st"), raw_file("{\"\xff\xfe\": 1}"), "not valid JSON");
  expect_rejected(path("array.st"), raw_file("[1, 2]"), "not a JSON object");
  expect_rejected(path("entry.st"), raw_file(R"({"t": 5})"), "tensor \"t\": entry is not a JSON object");
  expect_rejected(path("missing.st"), raw_file(R"({"t": {"dtype": "F32", "shape": [1]}})"),
                  "tensor \"t\": missing field \"data_offsets\"");
  expect_rejected(
      path("extra.st"),
      raw_file(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}})", std::string(4, '\0')),
      "tensor \"t\": unexpected field \"x\"");
  expect_rejected(path("dtype_type.st"), raw_file(R"({"t": {"dtype": 3, "shape": [1], "data_offsets": [0, 4]}})"),
                  "tensor \"t\": dtype is not a string");
  expect_rejected(path("dtype_name.st"), raw_file(R"({"t": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}})"),
                  "tensor \"t\": unknown dtype \"F31\"");
  expect_rejected(path("shape_type.st"), raw_file(R"({"t": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}})"),
                  "tensor \"t\": shape is not an array");
  expect_rejected(path("shape_neg.st"), raw_file(R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})"),
                  "tensor \"t\": shape element 0 is not a non-negative integer");
  expect_rejected(path("shape_float.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": [2, 1.0], "data_offsets": [0, 8]}})"),
                  "tensor \"t\": shape element 1 is not a non-negative integer");
  expect_rejected(path("shape_huge.st"),
                  raw_file(R"({"t": {"dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 4]}})"),
                  "tensor \"t\": shape element 0");
  expect_rejected(path("offsets_len.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})"),
                  "tensor \"t\": data_offsets is not an array of two integers");
  expect_rejected(path("offsets_type.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": ["0", 4]}})"),
                  "tensor \"t\": data_offsets are not non-negative integers");
  expect_rejected(path("offsets_neg.st"), raw_file(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})"),
                  "tensor \"t\": data_offsets are not non-negative integers");
  expect_rejected(path("offsets_order.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}})", std::string(4, '\0')),
                  "tensor \"t\": data_offsets [4, 0] begin after end");
}

TEST_F(SafetensorsTest, rejects_sizes_and_offsets_that_do_not_fit) {
  const std::string data(16, '\0');
  expect_rejected(path("span.st"), raw_file(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", data),
                  "tensor \"t\": F32 shape [3] needs 12 bytes but data_offsets [0, 16] span 16");
  // 2^62 * 2^62 elements: the element count overflows 64 bits.
  expect_rejected(path("numel_overflow.st"),
                  raw_file(R"({"t": {"dtype": "U8", "shape": [4611686018427387904, 4611686018427387904],)"
                           R"( "data_offsets": [0, 16]}})",
                           data),
                  "tensor \"t\": shape [4611686018427387904, 4611686018427387904] is too large");
  // 2^62 F32 elements: the byte count overflows 64 bits.
  expect_rejected(path("bytes_overflow.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 16]}})", data),
                  "is too large");
  // An end offset near 2^64 whose span matches the shape: caught by the data-section bound.
  expect_rejected(path("offset_huge.st"),
                  raw_file(R"({"t": {"dtype": "U8", "shape": [16], )"
                           R"("data_offsets": [18446744073709551599, 18446744073709551615]}})",
                           data),
                  "run past the data section (16 bytes)");
  expect_rejected(path("past_data.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]}})", data),
                  "tensor \"t\": data_offsets [4, 20] run past the data section (16 bytes)");
  expect_rejected(path("overlap.st"),
                  raw_file(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},)"
                           R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                           data),
                  "tensor \"b\" (bytes [8, 16)) overlaps tensor \"a\"");
  expect_rejected(path("hole.st"),
                  raw_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                           R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                           data),
                  "data section has a hole: bytes [4, 8) before tensor \"b\"");
  expect_rejected(path("leading_hole.st"),
                  raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})", data),
                  "bytes [0, 8) before tensor \"a\"");
  expect_rejected(path("trailing.st"),
                  raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", data),
                  "8 bytes after the last tensor");
  expect_rejected(path("no_tensors_data.st"), raw_file("{}", data), "16 bytes after the last tensor");
}

TEST_F(SafetensorsTest, rejects_duplicates_and_bad_metadata) {
  const std::string data(8, '\0');
  expect_rejected(path("dup_name.st"),
                  raw_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                           R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                           data),
                  "duplicate tensor name \"a\"");
  expect_rejected(path("dup_field.st"),
                  raw_file(R"({"a": {"dtype": "F32", "dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})", data),
                  "duplicate field \"dtype\" in \"a\"");
  expect_rejected(path("meta_type.st"), raw_file(R"({"__metadata__": ["x"]})"), "__metadata__ is not a JSON object");
  expect_rejected(path("meta_value.st"), raw_file(R"({"__metadata__": {"format": "pt", "n": 3}})"),
                  "__metadata__ value of \"n\" is not a string");
  expect_rejected(path("dup_meta.st"), raw_file(R"({"__metadata__": {"k": "a", "k": "b"}})"),
                  "duplicate field \"k\" in \"__metadata__\"");
}

// A header holding a 10 MB tensor name: the error echoes 179 characters of it and the count of the
// rest (include/latentmoe/error.h); the command line's whole line: tests/test_cli.cpp.
TEST_F(SafetensorsTest, a_ten_megabyte_tensor_name_is_echoed_short_with_the_count_left_out) {
  const std::string file = path("long_name.st");
  write_all(file, raw_file("{\"" + std::string(10'000'000, 'n') +
                               R"(": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}})",
                           std::string(4, '\0')));
  std::string message;
  try {
    const SafetensorsFile opened = SafetensorsFile::open(file);
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_EQ(message, file + ": tensor \"" + std::string(179, 'n') + "...(+9,999,821 more)\": unknown dtype \"F31\"");
  EXPECT_LT(message.size() - file.size(), 250u);
}

TEST_F(SafetensorsTest, survives_deeply_nested_json) {
  // 100k nested arrays in a shape: refused at depth 9, before anything deeper is built.
  const std::string nested = std::string(100000, '[') + std::string(100000, ']');
  expect_rejected(path("nested.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": )" + nested + R"(, "data_offsets": [0, 0]}})"),
                  "nested more than 8 levels deep");
}

TEST_F(SafetensorsTest, nesting_depth_is_bounded_before_memory_grows) {
  // 8 levels (header, entry, shape, 5 more) still reach the specific message; 9 do not get parsed.
  const std::string depth8 = R"({"t": {"dtype": "F32", "shape": [[[[[[0]]]]]], "data_offsets": [0, 0]}})";
  expect_rejected(path("depth8.st"), raw_file(depth8), "shape element 0 is not a non-negative integer");
  const std::string depth9 = R"({"t": {"dtype": "F32", "shape": [[[[[[[0]]]]]]], "data_offsets": [0, 0]}})";
  expect_rejected(path("depth9.st"), raw_file(depth9), "nested more than 8 levels deep");
  // Brackets inside strings are not nesting.
  const std::string brackets = std::string(1000, '[') + std::string(1000, '{');
  write_all(path("strings.st"), raw_file(R"({"__metadata__": {"k": ")" + brackets + R"("}})"));
  EXPECT_EQ(SafetensorsFile::open(path("strings.st")).metadata().at("k"), brackets);

  // A 20 MB header of nested arrays (once several GB of parsed values) is refused at once.
  const size_t depth = 10'000'000;
  const auto start = std::chrono::steady_clock::now();
  expect_rejected(path("deep20mb.st"),
                  raw_file(R"({"t": {"dtype": "F32", "shape": )" + std::string(depth, '[') + std::string(depth, ']') +
                           R"(, "data_offsets": [0, 0]}})"),
                  "nested more than 8 levels deep");
  // Also inside __metadata__ and a wrongly typed dtype (contents skipped, depth still counted).
  expect_rejected(path("deep_meta.st"), raw_file(R"({"__metadata__": {"k": )" + std::string(100, '[') + "}}"),
                  "__metadata__ value of \"k\" is not a string");
  std::string nested_objects;
  for (int i = 0; i < 100; ++i) nested_objects += R"({"x": )";
  nested_objects += "1" + std::string(100, '}');
  expect_rejected(path("deep_dtype.st"), raw_file(R"({"t": {"dtype": )" + nested_objects + "}}"),
                  "nested more than 8 levels deep");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LATENTMOE_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define LATENTMOE_TEST_SANITIZED 1
#endif
#endif

TEST_F(SafetensorsTest, out_of_memory_in_the_header_is_one_error_naming_the_file) {
#ifdef LATENTMOE_TEST_SANITIZED
  GTEST_SKIP() << "an address-space limit breaks the sanitizer runtime";
#else
  // A legal, flat 24 MB header (one shape of 12M zeros) parsed under an address-space limit too
  // small for its values: a child process, so the limit binds nothing else.
  std::string zeros;
  zeros.reserve(24'000'000);
  for (int i = 0; i < 12'000'000; ++i) zeros += i == 0 ? "0" : ",0";
  const std::string file = path("flat.st");
  write_all(file, raw_file(R"({"t": {"dtype": "F32", "shape": [)" + zeros + R"(], "data_offsets": [0, 0]}})"));
  zeros = std::string();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    long pages = 0;
    if (std::FILE* statm = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
      std::fclose(statm);
    }
    if (pages <= 0) ::_exit(10);
    const rlim_t limit = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (rlim_t{96} << 20);
    struct rlimit address_space {
      limit, limit
    };
    if (::setrlimit(RLIMIT_AS, &address_space) != 0) ::_exit(11);
    try {
      SafetensorsFile opened = SafetensorsFile::open(file);
      ::_exit(3);  // opened: the limit did not bind
    } catch (const Error& error) {
      const std::string message = error.what();
      ::_exit(message.find(file) != std::string::npos && message.find("out of memory") != std::string::npos &&
                      message.find('\n') == std::string::npos
                  ? 0
                  : 1);
    } catch (const std::bad_alloc&) {
      ::_exit(2);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "child died with signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: other error, 2: bare std::bad_alloc, 3: opened, 4: other exception";
#endif
}

TEST_F(SafetensorsTest, a_header_of_100k_tensors_opens_in_linear_time) {
  // Tiny U8 tensors, listed in reverse data order so the reader has to sort them.
  constexpr int kCount = 100'000;
  std::string header = R"({"__metadata__": {"format": "pt"})";
  header.reserve(size_t{kCount} * 64);
  for (int i = kCount - 1; i >= 0; --i) {
    header += ",\"t" + std::to_string(i) + R"(": {"dtype": "U8", "shape": [1], "data_offsets": [)" + std::to_string(i) +
              ", " + std::to_string(i + 1) + "]}";
  }
  header += "}";
  std::string data(kCount, '\0');
  for (int i = 0; i < kCount; ++i) data[i] = static_cast<char>(i % 251);
  write_all(path("many.st"), raw_file(header, data));

  const auto start = std::chrono::steady_clock::now();
  const SafetensorsFile file = SafetensorsFile::open(path("many.st"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0) << "opening a header of " << kCount << " tensors took " << seconds << " s";
  ASSERT_EQ(file.entries().size(), size_t{kCount});
  EXPECT_EQ(file.entries().front().name, "t0");
  EXPECT_EQ(file.entries().back().name, "t" + std::to_string(kCount - 1));
  EXPECT_EQ(file.read("t77777").data_as<uint8_t>()[0], 77777 % 251);

  // A duplicate among them is still found.
  expect_rejected(path("many_dup.st"), raw_file(header.substr(0, header.size() - 1) + R"(, "t5": {}})", data),
                  "duplicate tensor name \"t5\"");
}

TEST_F(SafetensorsTest, open_refuses_fifos_and_directories_without_blocking) {
  // open() of a FIFO with no writer would block forever; it must be refused at once.
  const std::string fifo = path("input.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  try {
    SafetensorsFile::open(fifo);
    ADD_FAILURE() << "opened a FIFO";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(fifo + ": not a regular file"), std::string::npos) << error.what();
  }
  fs::create_directories(dir_ / "subdir");
  try {
    SafetensorsFile::open(path("subdir"));
    ADD_FAILURE() << "opened a directory";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(path("subdir") + ": not a regular file"), std::string::npos)
        << error.what();
  }
}

TEST_F(SafetensorsTest, rejects_every_truncation_of_a_valid_file) {
  float values[6] = {1, 2, 3, 4, 5, 6};
  const std::string good = path("good.safetensors");
  write_safetensors(good, {{"x", TensorView(values, DType::f32, {2, 3})}, {"y", TensorView(values, DType::f32, {2})}});
  const std::string raw = read_all(good);
  for (size_t size = 0; size < raw.size(); ++size) {
    write_all(path("cut.st"), raw.substr(0, size));
    EXPECT_THROW(SafetensorsFile::open(path("cut.st")), Error) << "truncated to " << size << " bytes";
  }
  EXPECT_EQ(SafetensorsFile::open(good).entries().size(), 2u);
}

TEST_F(SafetensorsTest, fuzzed_files_open_cleanly_or_throw) {
  float values[6] = {1, 2, 3, 4, 5, 6};
  uint16_t half[3] = {1, 2, 3};
  const std::string good = path("seed.safetensors");
  write_safetensors(good,
                    {{"x", TensorView(values, DType::f32, {2, 3})},
                     {"y", TensorView(half, DType::bf16, {3})},
                     {"z", TensorView(values, DType::f32, {1})}},
                    {{"format", "pt"}});
  const std::string raw = read_all(good);

  uint64_t state = 12345;  // splitmix64: fixed, portable sequence of mutations
  auto next = [&state]() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  // Bytes worth substituting: JSON punctuation and digits make near-valid headers likelier.
  const std::string interesting = "{}[]\":,0123456789-. eE\"\\";
  int num_opened = 0, num_rejected = 0;
  const std::string mutant_path = path("mutant.st");
  for (int iteration = 0; iteration < 3000; ++iteration) {
    std::string mutant = raw;
    const uint64_t choice = next();
    if (choice % 10 == 0) {
      mutant.resize(next() % raw.size());
    } else {
      const size_t position = next() % mutant.size();
      mutant[position] = (choice % 3 == 0) ? static_cast<char>(next()) : interesting[next() % interesting.size()];
    }
    write_all(mutant_path, mutant);
    try {
      SafetensorsFile file = SafetensorsFile::open(mutant_path);
      ++num_opened;
      uint64_t header_size = 0;
      for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<unsigned char>(mutant[i]);
      const uint64_t data_size = mutant.size() - 8 - header_size;
      for (const SafetensorsEntry& entry : file.entries()) {
        ASSERT_LE(entry.begin, entry.end);
        ASSERT_LE(entry.end, data_size) << "iteration " << iteration;
        HostTensor copy = file.read(entry.name);
        ASSERT_EQ(copy.nbytes(), entry.end - entry.begin);
        ASSERT_EQ(std::memcmp(copy.data(), mutant.data() + 8 + header_size + entry.begin, copy.nbytes()), 0);
      }
    } catch (const Error&) {
      ++num_rejected;
    }
  }
  // Both outcomes must occur, or the loop tests nothing (e.g. every mutation hitting one region).
  EXPECT_GT(num_opened, 100);
  EXPECT_GT(num_rejected, 100);
}

TEST_F(SafetensorsTest, writer_rejects_bad_tensor_lists) {
  float value = 0;
  const std::string target = path("bad.safetensors");
  auto expect_write_error = [&](const std::vector<std::pair<std::string, TensorView>>& tensors,
                                const std::string& expected) {
    try {
      write_safetensors(target, tensors);
      ADD_FAILURE() << "write did not throw; expected " << expected;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
    EXPECT_TRUE(directory_listing(dir_).empty());
  };
  expect_write_error({{"a", TensorView(&value, DType::f32, {1})}, {"a", TensorView(&value, DType::f32, {1})}},
                     "duplicate tensor name \"a\"");
  expect_write_error({{"__metadata__", TensorView(&value, DType::f32, {1})}}, "cannot be named __metadata__");
  expect_write_error({{"u", TensorView()}}, "tensor \"u\" is undefined");
  expect_write_error({{"g", TensorView(&value, DType::f32, {1}, Device::cuda)}}, "not in host memory");
  expect_write_error({{"\xff", TensorView(&value, DType::f32, {1})}}, "UTF-8");
}

TEST_F(SafetensorsTest, atomic_write_leaves_nothing_on_failure) {
  float values[2] = {1.0f, 2.0f};
  const std::vector<std::pair<std::string, TensorView>> tensors = {{"v", TensorView(values, DType::f32, {2})}};

  // A directory that does not exist: a clear error, and nothing is created.
  const fs::path missing_dir = dir_ / "no_such_dir";
  try {
    write_safetensors((missing_dir / "out.safetensors").string(), tensors);
    ADD_FAILURE() << "write into a missing directory did not throw";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("cannot create a file in directory"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(fs::exists(missing_dir));

  // A path below a regular file.
  write_all(path("plain"), "x");
  EXPECT_THROW(write_safetensors(path("plain") + "/out.safetensors", tensors), Error);

  // The target is a non-empty directory: refused, and no temporary file is left.
  fs::create_directories(dir_ / "target.safetensors" / "child");
  EXPECT_THROW(write_safetensors(path("target.safetensors"), tensors), Error);
  EXPECT_EQ(directory_listing(dir_), (std::vector<std::string>{"plain", "target.safetensors"}));

  // Overwriting an existing file replaces it whole.
  write_all(path("over.safetensors"), "old contents");
  write_safetensors(path("over.safetensors"), tensors);
  EXPECT_EQ(SafetensorsFile::open(path("over.safetensors")).read("v").data_as<float>()[1], 2.0f);
  EXPECT_EQ(directory_listing(dir_), (std::vector<std::string>{"over.safetensors", "plain", "target.safetensors"}));

  // An unwritable directory (permissions do not bind root, so only checked for other users).
  if (::geteuid() != 0) {
    fs::create_directories(dir_ / "readonly");
    fs::permissions(dir_ / "readonly", fs::perms::owner_read | fs::perms::owner_exec);
    try {
      write_safetensors((dir_ / "readonly" / "out.safetensors").string(), tensors);
      ADD_FAILURE() << "write into a read-only directory did not throw";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("Permission denied"), std::string::npos) << error.what();
    }
    fs::permissions(dir_ / "readonly", fs::perms::owner_all);
    EXPECT_TRUE(directory_listing(dir_ / "readonly").empty());
  }
}

TEST_F(SafetensorsTest, open_reports_missing_file_and_directory) {
  try {
    SafetensorsFile::open(path("nope.safetensors"));
    ADD_FAILURE() << "opened a missing file";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(path("nope.safetensors") + ": cannot open"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW(SafetensorsFile::open(dir_.string()), Error);
}

TEST_F(SafetensorsTest, writer_refuses_an_output_that_is_not_a_regular_file) {
  float values[2] = {1.0f, 2.0f};
  const std::vector<std::pair<std::string, TensorView>> tensors = {{"v", TensorView(values, DType::f32, {2})}};
  auto expect_refused = [&](const std::string& target) {
    try {
      write_safetensors(target, tensors);
      ADD_FAILURE() << "wrote over " << target;
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(target + ": exists and is not a regular file"), std::string::npos) << message;
    }
  };
  // A FIFO stays a FIFO (the rename would have replaced it with a regular file).
  const std::string fifo = path("out.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  expect_refused(fifo);
  struct stat info {};
  ASSERT_EQ(::lstat(fifo.c_str(), &info), 0);
  EXPECT_TRUE(S_ISFIFO(info.st_mode));
  // A device, through a symlink (so a regression would replace the link, never /dev/null itself).
  fs::create_symlink("/dev/null", dir_ / "null_link");
  expect_refused(path("null_link"));
  EXPECT_TRUE(fs::is_symlink(dir_ / "null_link"));
  // A directory, empty or not.
  fs::create_directories(dir_ / "empty_dir");
  expect_refused(path("empty_dir"));
  EXPECT_EQ(directory_listing(dir_), (std::vector<std::string>{"empty_dir", "null_link", "out.fifo"}));
  // A symlink to a regular file is still replaced by the new file, as before.
  write_all(path("old.safetensors"), "old");
  fs::create_symlink(path("old.safetensors"), dir_ / "file_link");
  write_safetensors(path("file_link"), tensors);
  EXPECT_EQ(SafetensorsFile::open(path("file_link")).read("v").data_as<float>()[1], 2.0f);
}

TEST_F(SafetensorsTest, writer_respects_the_file_size_limit) {
  std::vector<float> values(16384, 1.0f);  // 64 KiB of data
  const std::vector<std::pair<std::string, TensorView>> tensors = {
      {"v", TensorView(values.data(), DType::f32, {static_cast<int64_t>(values.size())})}};
  // A regression would be killed by SIGXFSZ; ignored here, it would surface as a write error.
  struct sigaction ignore {
  }, previous{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &previous), 0);
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  struct rlimit small = saved;
  small.rlim_cur = 4096;
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < small.rlim_cur) small.rlim_cur = saved.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    write_safetensors(path("big.safetensors"), tensors);
  } catch (const Error& error) {
    message = error.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::sigaction(SIGXFSZ, &previous, nullptr);
  EXPECT_NE(message.find(path("big.safetensors") + ": "), std::string::npos) << message;
  EXPECT_NE(message.find("file size limit"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_TRUE(directory_listing(dir_).empty()) << "a temporary file was left behind";
  // Without the limit the same write succeeds.
  write_safetensors(path("big.safetensors"), tensors);
  EXPECT_EQ(SafetensorsFile::open(path("big.safetensors")).entries().size(), 1u);
}

TEST_F(SafetensorsTest, writer_accepts_names_up_to_name_max) {
  float values[2] = {1.0f, 2.0f};
  const std::vector<std::pair<std::string, TensorView>> tensors = {{"v", TensorView(values, DType::f32, {2})}};
  for (size_t length : {250u, 255u}) {
    const std::string name = std::string(length - 12, 'n') + ".safetensors";
    ASSERT_EQ(name.size(), length);
    write_safetensors(path(name), tensors);
    EXPECT_EQ(SafetensorsFile::open(path(name)).read("v").data_as<float>()[0], 1.0f);
  }
  EXPECT_EQ(directory_listing(dir_).size(), 2u);  // no temporary file left
}

}  // namespace
}  // namespace latentmoe
