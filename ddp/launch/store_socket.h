#pragma once
// Where a job's store answers (issue 41, "no one else in"): rank 0's TCPStore and ddp-launch's job store listen on the
// address the ranks reach them by (MASTER_ADDR), not on every interface as c10d's TCPStore does by itself. A job whose
// MASTER_ADDR is the loopback address (a one-node job: ddp-launch's default) is then reachable from this machine only;
// a multi-node job's store answers on the interface that carries MASTER_ADDR. The store has no authentication (as
// PyTorch's): whoever can reach that address and port can still write into it (docs/clusters.md).
#include <optional>
#include <string>

#include <netinet/in.h>

namespace ddp::detail {

/// `host`'s IPv4 address: a dotted literal, "localhost" (127.0.0.1), or a name resolved (getaddrinfo, IPv4 only).
/// nullopt when the name has no IPv4 address.
std::optional<in_addr> ipv4_address_of(const std::string& host);

/// A listening TCP socket on `host`'s IPv4 address and `port` (0: any free port), for a TCPStore to serve on
/// (c10d::TCPStoreOptions::masterListenFd, which then owns it). -1, and the caller lets the store listen as it does by
/// itself, on every interface, when `host` has no IPv4 address; when it has one that is not this machine's (a name
/// that resolves to a Kubernetes service's virtual address); or when `one_node` is false and `host` is a name that
/// resolves to a loopback address here (Debian's "127.0.1.1 <hostname>" line in /etc/hosts) while the other nodes
/// reach it by another. The last two are said on stderr. Throws std::runtime_error with the system's reason
/// ("Address already in use") when the bind fails otherwise.
int store_listen_socket(const std::string& host, int port, bool one_node);

}  // namespace ddp::detail
