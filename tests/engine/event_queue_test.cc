// EventQueue's inflow bound: the handler of a tree session waits once kInflowLimit commands
// wait for the engine, and goes on when the engine takes one or the stream ends.
#include "engine/works/event_queue.h"

#include <gtest/gtest.h>

#include <thread>

namespace deft::engine {
namespace {

using Queue = EventQueue<int>;
constexpr std::chrono::milliseconds kNoWait{0};

TEST(EventQueueInflow, TheHandlerWaitsAtTheLimitUntilTheEngineTakesOne) {
  Queue queue;
  for (int32_t i = 0; i < Queue::kInflowLimit; ++i) {
    ASSERT_TRUE(queue.wait_inflow_room(kNoWait)) << i;
    queue.inflow_added();
  }
  EXPECT_FALSE(queue.wait_inflow_room(std::chrono::milliseconds(5)));
  std::thread engine([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    queue.inflow_taken();
  });
  EXPECT_TRUE(queue.wait_inflow_room(std::chrono::seconds(10)));
  engine.join();
  EXPECT_EQ(queue.inflow(), Queue::kInflowLimit - 1);
}

TEST(EventQueueInflow, TheStreamsEndReleasesAWaitingHandler) {
  Queue queue;
  for (int32_t i = 0; i < Queue::kInflowLimit; ++i) queue.inflow_added();
  std::thread engine([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    queue.finish(absl::OkStatus());
  });
  EXPECT_TRUE(queue.wait_inflow_room(std::chrono::seconds(10)));
  engine.join();
}

}  // namespace
}  // namespace deft::engine
