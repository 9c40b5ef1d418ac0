// SHA-256 against FIPS 180-4's test vectors, across block boundaries and split updates, and of a
// file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "../../support/temp_dir.h"
#include "hpctrial/core/digest.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

std::string sha256(const std::string& text) {
  Sha256 sha;
  sha.update(text);
  return sha.hex();
}

TEST(Sha256, MatchesTheStandardsVectors) {
  EXPECT_EQ(sha256(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, SplitUpdatesGiveTheWholeTextsDigest) {
  const std::string text(200, 'x');
  for (std::size_t cut : {0u, 1u, 55u, 56u, 63u, 64u, 65u, 128u, 199u}) {
    Sha256 sha;
    sha.update(text.substr(0, cut));
    sha.update(text.substr(cut));
    EXPECT_EQ(sha.hex(), sha256(text)) << "cut at " << cut;
  }
}

TEST(Sha256, OfAFileAndOfOneThatCannotBeRead) {
  testing_support::TempDir dir;
  const std::string path = dir.write("program", "abc");
  EXPECT_EQ(file_sha256(path), sha256("abc"));
  try {
    file_sha256((dir.path() / "none").string());
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("cannot read " + (dir.path() / "none").string()));
  }
}

}  // namespace
}  // namespace hpctrial::core
