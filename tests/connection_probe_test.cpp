// The probe finds the server side of a loopback TCP connection by its
// endpoints and sees the client leave, without consuming pending bytes.
#include "server/connection_probe.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kvserve {
namespace {

int port_of(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (peer) {
    getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len);
  } else {
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  }
  return ntohs(a.sin_port);
}

TEST(ConnectionProbe, FindsTheServerSideAndSeesTheClientLeave) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  const int server_port = port_of(listener, false);
  addr.sin_port = htons(uint16_t(server_port));
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const int accepted = accept(listener, nullptr, nullptr);
  ASSERT_GE(accepted, 0);
  const int client_port = port_of(client, false);

  const ConnectionProbe probe = ConnectionProbe::find("127.0.0.1", client_port, server_port);
  ASSERT_TRUE(probe.valid());
  EXPECT_FALSE(probe.closed());
  // Pending bytes (a pipelined request) are not a hang-up, and stay unread.
  ASSERT_EQ(send(client, "GET", 3, 0), 3);
  usleep(10000);
  EXPECT_FALSE(probe.closed());
  char buf[3];
  EXPECT_EQ(recv(accepted, buf, 3, MSG_DONTWAIT), 3);

  // Not the client's own socket (its peer is the server port), nor a stranger.
  EXPECT_FALSE(ConnectionProbe::find("127.0.0.1", client_port, client_port).valid());
  EXPECT_FALSE(ConnectionProbe::find("127.0.0.2", client_port, server_port).valid());
  EXPECT_FALSE(ConnectionProbe().closed());

  close(client);
  usleep(10000);
  EXPECT_TRUE(probe.closed());
  close(accepted);
  close(listener);
}

TEST(ConnectionProbe, ShutdownAllClosesTheServerSideOfAPortOnly) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  addr.sin_port = htons(uint16_t(port_of(listener, false)));
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const int accepted = accept(listener, nullptr, nullptr);
  ASSERT_GE(accepted, 0);
  // Only the accepted socket has the listening port as its local port.
  EXPECT_EQ(ConnectionProbe::shutdown_all(port_of(listener, false)), 1);
  char byte;
  EXPECT_EQ(recv(client, &byte, 1, 0), 0);  // the client sees end-of-file
  EXPECT_EQ(send(client, "x", 1, MSG_NOSIGNAL), 1);  // its own side was left alone
  close(client);
  close(accepted);
  close(listener);
}

}  // namespace
}  // namespace kvserve
