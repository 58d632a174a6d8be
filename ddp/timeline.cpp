#include <ddp/timeline.h>

#include <unistd.h>
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/StringUtil.h>

#include <ddp/json.h>
#include <ddp/process_group.h>

namespace ddp {

namespace {

bool on_device(const std::optional<c10::Stream>& stream) {
  return stream && stream->device_type() != c10::DeviceType::CPU;
}

// The bytes one rank sends in gather_timeline: per event its name and lane (length, bytes), then step, bucket, start
// and end; the first 8 bytes are the host's id.
void put_bytes(std::string& out, const void* data, size_t size) { out.append(static_cast<const char*>(data), size); }
template <typename T>
void put(std::string& out, const T& value) {
  put_bytes(out, &value, sizeof value);
}
void put_text(std::string& out, const std::string& text) {
  put<uint32_t>(out, static_cast<uint32_t>(text.size()));
  out += text;
}

struct Reader {
  const char* at;
  const char* end;
  template <typename T>
  T take() {
    TORCH_CHECK(at + sizeof(T) <= end, "gather_timeline: a rank's events are truncated");
    T value;
    std::memcpy(&value, at, sizeof value);
    at += sizeof value;
    return value;
  }
  std::string take_text() {
    const auto size = take<uint32_t>();
    TORCH_CHECK(at + size <= end, "gather_timeline: a rank's events are truncated");
    std::string text(at, size);
    at += size;
    return text;
  }
};

uint64_t host_id() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return std::hash<std::string>{}(name);
}

}  // namespace

double steady_microseconds(Timeline::Clock::time_point time) {
  return std::chrono::duration<double, std::micro>(time.time_since_epoch()).count();
}

Timeline::Timeline(TimelineWindow window) : window_(window) {
  if (window.first_step < 1 || window.last_step < window.first_step ||
      window.last_step - window.first_step >= kMaxTimelineSteps) {
    throw std::invalid_argument(
        c10::str("Timeline: the window must be steps first..last with 1 <= first <= last, at most ", kMaxTimelineSteps,
                 " steps, got ", window.first_step, "..", window.last_step));
  }
}

void Timeline::begin_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = step;
  in_step_ = step >= window_.first_step && step <= window_.last_step;
}

void Timeline::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (in_step_ && step_ >= window_.last_step) finished_ = true;
  in_step_ = false;
}

bool Timeline::recording() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_step_;
}

bool Timeline::finished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_;
}

int64_t Timeline::step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return step_;
}

Timeline::Mark Timeline::mark(const std::optional<c10::Stream>& stream) {
  Mark mark;
  if (on_device(stream)) {
    mark.event = std::make_shared<c10::Event>(stream->device_type(), c10::EventFlag::BACKEND_DEFAULT);
    mark.event->record(*stream);
  } else {
    mark.host = Clock::now();
  }
  return mark;
}

void Timeline::add(const std::string& name, const std::string& lane, const Mark& start, const Mark& end,
                   int64_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_step_) return;
  pending_.push_back(Pending{TimelineEvent{name, lane, step_, bucket, 0.0, 0.0}, start, end});
}

void Timeline::add(const std::string& name, const std::string& lane, Clock::time_point start, Clock::time_point end,
                   int64_t bucket) {
  add(name, lane, Mark{start, nullptr}, Mark{end, nullptr}, bucket);
}

std::vector<TimelineEvent> Timeline::resolve() {
  std::lock_guard<std::mutex> lock(mutex_);
  // One final event per device, waited for: its completion is "now" on the host, and every mark of that device lies
  // the device time from it to the final event before that.
  std::map<std::pair<int, int>, std::pair<std::shared_ptr<c10::Event>, Clock::time_point>> finals;
  const auto final_for =
      [&](const c10::Event& mark) -> const std::pair<std::shared_ptr<c10::Event>, Clock::time_point>& {
    const std::pair<int, int> key{static_cast<int>(mark.device_type()), static_cast<int>(mark.device_index())};
    auto found = finals.find(key);
    if (found == finals.end()) {
      const c10::Device device(mark.device_type(), mark.device_index());
      auto final_event = std::make_shared<c10::Event>(mark.device_type(), c10::EventFlag::BACKEND_DEFAULT);
      final_event->record(c10::impl::VirtualGuardImpl(mark.device_type()).getStream(device));
      final_event->synchronize();
      found = finals.emplace(key, std::make_pair(final_event, Clock::now())).first;
    }
    return found->second;
  };
  const auto time_of = [&](const Mark& mark) {
    if (mark.host) return steady_microseconds(*mark.host);
    const auto& [final_event, final_host] = final_for(*mark.event);
    mark.event->synchronize();
    return steady_microseconds(final_host) - 1000.0 * mark.event->elapsedTime(*final_event);
  };
  std::vector<TimelineEvent> events;
  events.reserve(pending_.size());
  for (const Pending& p : pending_) {
    TimelineEvent event = p.event;
    event.start_us = time_of(p.start);
    event.end_us = std::max(event.start_us, time_of(p.end));
    events.push_back(std::move(event));
  }
  return events;
}

std::vector<std::vector<TimelineEvent>> gather_timeline(const ProcessGroup& group,
                                                        const std::vector<TimelineEvent>& events) {
  std::string bytes;
  put<uint64_t>(bytes, host_id());
  for (const TimelineEvent& e : events) {
    put_text(bytes, e.name);
    put_text(bytes, e.lane);
    put(bytes, e.step);
    put(bytes, e.bucket);
    put(bytes, e.start_us);
    put(bytes, e.end_us);
  }
  const auto device = group.device();
  const auto sizes = group.allgather(at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong).to(device));
  int64_t longest = 0;
  for (const at::Tensor& size : sizes) longest = std::max(longest, size.cpu().item<int64_t>());
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  const auto gathered = group.allgather(mine.to(device));

  std::vector<std::vector<TimelineEvent>> per_rank(gathered.size());
  std::vector<uint64_t> hosts;
  for (size_t r = 0; r < gathered.size(); ++r) {
    const at::Tensor rank_bytes = gathered[r].cpu().contiguous();
    const auto* begin = reinterpret_cast<const char*>(rank_bytes.data_ptr<uint8_t>());
    Reader reader{begin, begin + sizes[r].cpu().item<int64_t>()};
    hosts.push_back(reader.take<uint64_t>());
    while (reader.at < reader.end) {
      TimelineEvent e;
      e.name = reader.take_text();
      e.lane = reader.take_text();
      e.step = reader.take<int64_t>();
      e.bucket = reader.take<int64_t>();
      e.start_us = reader.take<double>();
      e.end_us = reader.take<double>();
      per_rank[r].push_back(std::move(e));
    }
  }
  // Hosts' steady clocks do not share an origin: with more than one host, each row starts at its own first event.
  if (std::adjacent_find(hosts.begin(), hosts.end(), std::not_equal_to<>()) != hosts.end()) {
    for (auto& rank_events : per_rank) {
      double first = 0.0;
      for (size_t i = 0; i < rank_events.size(); ++i) {
        first = i == 0 ? rank_events[i].start_us : std::min(first, rank_events[i].start_us);
      }
      for (TimelineEvent& e : rank_events) {
        e.start_us -= first;
        e.end_us -= first;
      }
    }
  }
  return per_rank;
}

std::string chrome_trace_json(const std::vector<std::vector<TimelineEvent>>& per_rank) {
  double origin = 0.0;
  bool any = false;
  for (const auto& rank_events : per_rank) {
    for (const TimelineEvent& e : rank_events) {
      origin = any ? std::min(origin, e.start_us) : e.start_us;
      any = true;
    }
  }
  // One event a line, so that a person can read the file and a tool can take it line by line.
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  const auto append = [&](const Json& event) {
    out += first ? "  " : ",\n  ";
    out += json_text(event);
    first = false;
  };
  for (size_t r = 0; r < per_rank.size(); ++r) {
    append({{"ph", "M"}, {"name", "process_name"}, {"pid", r}, {"args", {{"name", c10::str("rank ", r)}}}});
    std::map<std::string, size_t> lanes;  // lane -> thread id, in order of first use
    for (const TimelineEvent& e : per_rank[r]) {
      if (lanes.count(e.lane)) continue;
      const size_t tid = lanes.size();
      lanes[e.lane] = tid;
      append({{"ph", "M"}, {"name", "thread_name"}, {"pid", r}, {"tid", tid}, {"args", {{"name", e.lane}}}});
    }
    for (const TimelineEvent& e : per_rank[r]) {
      const Json args = {{"step", e.step}, {"bucket", e.bucket}};
      if (e.end_us <= e.start_us) {  // an instant ("bucket i ready")
        append({{"ph", "i"},
                {"s", "t"},
                {"name", e.name},
                {"cat", e.lane},
                {"pid", r},
                {"tid", lanes[e.lane]},
                {"ts", json_number(e.start_us - origin)},
                {"args", args}});
        continue;
      }
      append({{"ph", "X"},
              {"name", e.name},
              {"cat", e.lane},
              {"pid", r},
              {"tid", lanes[e.lane]},
              {"ts", json_number(e.start_us - origin)},
              {"dur", json_number(e.end_us - e.start_us)},
              {"args", args}});
    }
  }
  return out + "\n]}\n";
}

std::shared_ptr<CompletionTime> CompletionTime::watch(const c10::intrusive_ptr<c10d::Work>& work) {
  auto completed = std::make_shared<CompletionTime>();
  try {
    work->getFuture()->addCallback([completed](c10::ivalue::Future&) {
      const auto now = Timeline::Clock::now();
      std::lock_guard<std::mutex> lock(completed->mutex_);
      completed->at_ = now;
    });
  } catch (const c10::Error&) {
    return nullptr;  // a work without a future
  }
  return completed;
}

Timeline::Clock::time_point CompletionTime::at_or(Timeline::Clock::time_point fallback) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return at_.value_or(fallback);
}

std::optional<double> allreduce_overlap(const std::vector<TimelineEvent>& rank_events) {
  std::map<int64_t, double> gradients_done;  // step -> when autograd had produced every gradient
  for (const TimelineEvent& e : rank_events) {
    if (e.lane == "step" && e.name == kAllreduceWaitEvent) gradients_done[e.step] = e.start_us;
  }
  double total = 0.0;
  double hidden = 0.0;
  for (const TimelineEvent& e : rank_events) {
    if (e.lane != "comm") continue;
    const auto done = gradients_done.find(e.step);
    if (done == gradients_done.end()) continue;
    total += e.end_us - e.start_us;
    hidden += std::max(0.0, std::min(e.end_us, done->second) - e.start_us);
  }
  if (total <= 0.0) return std::nullopt;
  return hidden / total;
}

std::optional<double> collective_hidden_share(const std::vector<TimelineEvent>& rank_events,
                                              const std::string& collective) {
  const std::string prefix = collective + " ";
  const std::string wait_prefix = "wait " + prefix;
  double total = 0.0;
  double waited = 0.0;
  for (const TimelineEvent& e : rank_events) {
    if (e.lane == "comm" && e.name.rfind(prefix, 0) == 0) total += e.end_us - e.start_us;
    if (e.lane == "wait" && e.name.rfind(wait_prefix, 0) == 0) waited += e.end_us - e.start_us;
  }
  if (total <= 0.0) return std::nullopt;
  return std::clamp(1.0 - waited / total, 0.0, 1.0);
}

}  // namespace ddp
