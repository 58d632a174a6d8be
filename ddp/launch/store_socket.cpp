#include <ddp/launch/store_socket.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <stdexcept>

namespace ddp::detail {

std::optional<in_addr> ipv4_address_of(const std::string& host) {
  in_addr addr{};
  if (::inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return std::nullopt;
  addr = reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr;
  ::freeaddrinfo(found);
  return addr;
}

int store_listen_socket(const std::string& host, int port, bool one_node) {
  const std::optional<in_addr> address = ipv4_address_of(host);
  if (!address) return -1;
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &*address, text, sizeof(text));
  in_addr literal{};
  const bool named = host != "localhost" && ::inet_pton(AF_INET, host.c_str(), &literal) != 1;
  if (!one_node && named && (ntohl(address->s_addr) >> 24) == 127) {
    std::cerr << "ddp: " << host << " is " << text << " on this machine, a loopback address, and the job's other "
              << "nodes reach it by another: the store on port " << port << " listens on every interface\n";
    return -1;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr = *address;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket() failed: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as TCPStore's own socket: a port in TIME_WAIT
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int error = errno;
    ::close(fd);
    if (error == EADDRNOTAVAIL) {  // a name that resolves elsewhere (a Kubernetes service's virtual address)
      std::cerr << "ddp: " << host << " (" << text << ") is not an address of this machine: the store on port " << port
                << " listens on every interface\n";
      return -1;
    }
    throw std::runtime_error("cannot listen on " + std::string(text) + ":" + std::to_string(port) + " (" + host +
                             "): " + std::strerror(error));
  }
  return fd;
}

}  // namespace ddp::detail
