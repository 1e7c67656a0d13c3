// The end of a mutation fuzz test: both outcomes (a mutated input accepted and checked, or
// refused with a clear error) must have been exercised, and their counts go into the test's
// XML report (ctest --output-junit, --gtest_output).
#pragma once

#include <gtest/gtest.h>

namespace deft::testing {

inline void expect_both_outcomes(int accepted, int refused, int min_accepted, int min_refused) {
  EXPECT_GT(accepted, min_accepted);
  EXPECT_GT(refused, min_refused);
  ::testing::Test::RecordProperty("accepted", accepted);
  ::testing::Test::RecordProperty("refused", refused);
}

}  // namespace deft::testing
