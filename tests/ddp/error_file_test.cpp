// Error files (TORCHELASTIC_ERROR_FILE): what a failing worker writes for its launcher, and what the launcher reads
// back, in our layout and in torchrun's.
#include <ddp/launch/error_file.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "ddp/ddp_test_util.h"
#include "json_lines.h"
#include "test_util.h"

namespace {

void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

TEST(ErrorFileTest, AMessageWithQuotesNewlinesAndUnicodeSurvivesTheRoundTrip) {
  ddp_test::ScratchDir dir;
  const std::string message = "resume file \"x.pt\" is truncated\n\tat byte 12\\34 \xC3\xA9 \x01";
  const std::string json = ddp::detail::error_record_json(message, 3, 2, 1796000000);
  EXPECT_EQ(json.find('\n'), json.size() - 1) << "one line: " << json;
  write(dir.file("e.json"), json);
  EXPECT_EQ(ddp::detail::read_error_message(dir.file("e.json")), message);
  const test_json::Json record = test_json::parse(json);
  EXPECT_EQ(record["rank"], 3) << json;
  EXPECT_EQ(record["restart_count"], 2) << json;
  EXPECT_EQ(record["message"]["extraInfo"]["timestamp"], "1796000000") << json;  // torchelastic's: a string
}

// An exception's text may hold bytes that are not UTF-8 (a path, a system message): the record is still written, with
// U+FFFD in their place, rather than lost.
TEST(ErrorFileTest, BytesThatAreNotUtf8AreReplacedNotLost) {
  ddp_test::ScratchDir dir;
  ddp_test::EnvGuard guard({ddp::kErrorFileEnv});
  ::setenv(ddp::kErrorFileEnv, dir.file("error.json").c_str(), 1);
  ASSERT_TRUE(ddp::record_error("cannot open /data/\xff\xfe.bin"));
  EXPECT_EQ(ddp::detail::read_error_message(dir.file("error.json")), "cannot open /data/\xEF\xBF\xBD\xEF\xBF\xBD.bin");
}

TEST(ErrorFileTest, TorchrunsLayoutAndAPlainMessageAreRead) {
  ddp_test::ScratchDir dir;
  // As torch.distributed.elastic's @record writes it (errors/error_handler.py), members in another order.
  write(dir.file("torchrun.json"),
        R"({"message": {"extraInfo": {"py_callstack": "Traceback ...\n", "timestamp": "1700000000"},
            "message": "RuntimeError: CUDA error: out of memory \u00e9\ud83d\ude00"}})");
  EXPECT_EQ(ddp::detail::read_error_message(dir.file("torchrun.json")),
            "RuntimeError: CUDA error: out of memory \xC3\xA9\xF0\x9F\x98\x80");
  write(dir.file("plain.json"), R"({"rank": 1, "list": [1, {"a": null}, true], "message": "plain"})");
  EXPECT_EQ(ddp::detail::read_error_message(dir.file("plain.json")), "plain");
}

TEST(ErrorFileTest, AMissingDamagedOrMessagelessFileIsNoMessage) {
  ddp_test::ScratchDir dir;
  EXPECT_EQ(ddp::detail::read_error_message(dir.file("none.json")), std::nullopt);
  for (const std::string text : {"", "{", R"({"message": )", R"({"message": "unterminated)", R"({"rank": 1})",
                                 R"({"message": {"extraInfo": {}}})", R"({"message": ""})", "[1, 2]", "not json"}) {
    write(dir.file("bad.json"), text);
    EXPECT_EQ(ddp::detail::read_error_message(dir.file("bad.json")), std::nullopt) << text;
  }
}

TEST(ErrorFileTest, RecordErrorWritesTheNamedFileWithTheRankAndRestart) {
  ddp_test::ScratchDir dir;
  ddp_test::EnvGuard guard({ddp::kErrorFileEnv, "RANK", "TORCHELASTIC_RESTART_COUNT"});
  ::unsetenv(ddp::kErrorFileEnv);
  EXPECT_FALSE(ddp::record_error("nowhere to go"));
  ::setenv(ddp::kErrorFileEnv, dir.file("error.json").c_str(), 1);
  ::setenv("RANK", "5", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  ASSERT_TRUE(ddp::record_error("the disk is full"));
  EXPECT_EQ(ddp::detail::read_error_message(dir.file("error.json")), "the disk is full");
  const std::string json = test_util::read_file(dir.file("error.json"));
  const test_json::Json record = test_json::parse(json);
  EXPECT_EQ(record["rank"], 5) << json;
  EXPECT_EQ(record["restart_count"], 1) << json;
  EXPECT_EQ(test_util::folder_entries(dir.path()).size(), 1u) << "a temporary file was left";
  ::setenv(ddp::kErrorFileEnv, dir.file("no/such/folder/error.json").c_str(), 1);
  EXPECT_FALSE(ddp::record_error("cannot be written"));  // no throw, no crash: it runs while failing
}

}  // namespace
