#include <ddp/launch/signal_forwarding.h>

namespace ddp::detail {
namespace {

volatile std::sig_atomic_t g_pending_signal = 0;   // to forward, reset by the supervisor
volatile std::sig_atomic_t g_received_signal = 0;  // the last one received, for the exit code

extern "C" void on_forwarded_signal(int signal) {
  g_pending_signal = signal;
  g_received_signal = signal;
}

}  // namespace

SignalForwarding::SignalForwarding(bool ignore_after_signal) : ignore_after_signal_(ignore_after_signal) {
  g_pending_signal = 0;
  g_received_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_forwarded_signal;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) ::sigaction(kForwardedSignals[i], &action, &old_[i]);
}

SignalForwarding::~SignalForwarding() {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
    ::sigaction(kForwardedSignals[i], ignore_after_signal_ && g_received_signal != 0 ? &ignore : &old_[i], nullptr);
  }
}

volatile std::sig_atomic_t* SignalForwarding::pending() { return &g_pending_signal; }

int SignalForwarding::received() { return g_received_signal; }

}  // namespace ddp::detail
