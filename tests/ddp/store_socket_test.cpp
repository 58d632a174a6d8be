// The job's stores answer on MASTER_ADDR's address only (issue 41, "no one else in"): ddp-launch's job store and rank
// 0's rendezvous store of a job on the loopback address cannot be reached through this machine's other addresses.
// (tests/ddp/two_hosts_netns_test.sh checks that a two-host job, whose store answers on host 0's interface, still
// meets.)
#include <ddp/launch/store_socket.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>

#include <ddp/launch/job_store.h>
#include <ddp/launch/worker_group.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>

#include "ddp/ddp_test_util.h"
#include "ddp/scoped_env.h"

namespace {

/// An IPv4 address of this machine other than the loopback ones, or nullopt.
std::optional<std::string> other_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_UP) == 0 ||
        (i->ifa_flags & IFF_LOOPBACK) != 0) {
      continue;
    }
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    found = text;
  }
  ::freeifaddrs(list);
  return found;
}

/// Whether a TCP connection to address:port is accepted within 2 s.
bool connects(const std::string& address, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, address.c_str(), &addr.sin_addr);
  bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  if (!ok && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int error = 0;
    socklen_t len = sizeof(error);
    ok = ::poll(&p, 1, 2000) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0;
  }
  ::close(fd);
  return ok;
}

#define LTA_REQUIRE_OTHER_ADDRESS(address)                    \
  const std::optional<std::string> address = other_address(); \
  if (!address) GTEST_SKIP() << "this machine has no IPv4 address besides the loopback ones to connect from"

TEST(StoreSocketTest, TheLaunchersStoreOfAOneNodeJobAnswersOnTheLoopbackAddressOnly) {
  LTA_REQUIRE_OTHER_ADDRESS(address);
  const auto store = ddp::detail::JobStore::host("127.0.0.1", 0, /*one_node=*/true);
  EXPECT_TRUE(connects("127.0.0.1", store->port()));
  EXPECT_FALSE(connects(*address, store->port())) << "the store answered on " << *address;
}

TEST(StoreSocketTest, RankZerosStoreOfAOneNodeJobAnswersOnTheLoopbackAddressOnly) {
  LTA_REQUIRE_OTHER_ADDRESS(address);
  ddp_test::ScopedEnv env(ddp_test::kLaunchVariables);
  const int port = ddp::detail::find_free_port();
  ddp_test::ScopedEnv::set(
      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}, {"RANK", "0"}, {"WORLD_SIZE", "1"}});
  LTA_REQUIRE_GLOO();
  const ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().backend("gloo"));
  EXPECT_TRUE(connects("127.0.0.1", port));
  EXPECT_FALSE(connects(*address, port)) << "rank 0's store answered on " << *address;
}

TEST(StoreSocketTest, AnAddressThatIsNotThisMachinesLeavesTheStoreAsItWas) {
  EXPECT_EQ(ddp::detail::store_listen_socket("203.0.113.77", 0, true), -1);  // TEST-NET-3: nobody's
  EXPECT_EQ(ddp::detail::store_listen_socket("no-such-host.invalid", 0, true), -1);
  const int fd = ddp::detail::store_listen_socket("localhost", 0, true);
  ASSERT_GE(fd, 0);
  ::close(fd);
}

/// A multi-node job whose MASTER_ADDR is a name that resolves to a loopback address on node 0 (Debian's "127.0.1.1
/// <hostname>" in /etc/hosts) while the other nodes reach it by its real address: the store listens on every
/// interface rather than on the loopback address, where the other nodes could not reach it.
TEST(StoreSocketTest, ANameThatIsLoopbackHereListensEverywhereForSeveralNodes) {
  char name[256] = {};
  ASSERT_EQ(::gethostname(name, sizeof(name) - 1), 0);
  const auto address = ddp::detail::ipv4_address_of(name);
  if (!address || (ntohl(address->s_addr) >> 24) != 127) {
    GTEST_SKIP() << "this machine's name (" << name << ") does not resolve to a loopback address";
  }
  EXPECT_EQ(ddp::detail::store_listen_socket(name, 0, /*one_node=*/false), -1);
  const int fd = ddp::detail::store_listen_socket(name, 0, /*one_node=*/true);  // one node: the loopback address
  ASSERT_GE(fd, 0);
  ::close(fd);
}

}  // namespace
