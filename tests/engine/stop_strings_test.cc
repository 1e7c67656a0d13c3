#include "engine/works/stop_strings.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace deft::engine {
namespace {

TEST(StopStringsTest, FindsMatchEndingInNewBytes) {
  const std::vector<std::string> stops = {"\n\n", "END"};
  // "EN" was already there, "D" completes "END".
  StopStringMatch match = find_stop_string("answer: 42 END", 1, stops);
  ASSERT_TRUE(match.found());
  EXPECT_EQ(match.position, 11u);
  EXPECT_EQ(match.stop_index, 1u);
  // A match wholly inside the older text is not reported again.
  EXPECT_FALSE(find_stop_string("END and more", 4, stops).found());
  EXPECT_FALSE(find_stop_string("nothing here", 12, stops).found());
}

TEST(StopStringsTest, EarliestOfSeveralMatchesWins) {
  const std::vector<std::string> stops = {"cd", "bc"};
  const StopStringMatch match = find_stop_string("abcd", 4, stops);
  EXPECT_EQ(match.position, 1u);
  EXPECT_EQ(match.stop_index, 1u);
}

TEST(StopStringsTest, NewBytesLargerThanTextAndEmptyStops) {
  const std::vector<std::string> stops = {"", "x"};
  const StopStringMatch match = find_stop_string("ax", 100, stops);
  EXPECT_EQ(match.position, 1u);
  EXPECT_FALSE(find_stop_string("", 0, stops).found());
}

TEST(StopStringsTest, HoldbackIsTheLongestProperPrefixAtTheEnd) {
  const std::vector<std::string> stops = {"</answer>", "\n\n"};
  EXPECT_EQ(stop_string_holdback("the result </ans", stops), 5u);
  EXPECT_EQ(stop_string_holdback("line\n", stops), 1u);
  EXPECT_EQ(stop_string_holdback("plain", stops), 0u);
  EXPECT_EQ(stop_string_holdback("<", stops), 1u);
  // A whole stop string is a match, not a prefix to hold back.
  EXPECT_EQ(stop_string_holdback("x\n\n", std::vector<std::string>{"\n\n"}), 1u);
}

}  // namespace
}  // namespace deft::engine
