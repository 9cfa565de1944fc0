#include "parallel/trace.h"

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

namespace fp8moe::trace {
namespace {

struct Event {
  const char* name;
  const char* cat;
  char ph;
  int64_t ts, dur, id, arg;
};

// The main thread records; nothing else does (WatchScope and the runner run there).
struct State {
  bool on = false;
  std::vector<Event> events;
  int depth = 0;         // nesting of communication calls
  int64_t comm_t0 = 0;   // the outermost call's start (us)
  int64_t comm_us = 0;   // since the last reset
  int64_t ids = 0;
  int64_t t0 = 0;        // the recording's start (us)
};
State& st() {
  static State s;
  return s;
}

}  // namespace

bool on() { return st().on; }

void start() {
  st().events.clear();
  st().events.reserve(1 << 16);
  st().t0 = now_us();
  st().on = true;
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void complete(const char* name, const char* cat, int64_t ts_us, int64_t dur_us, int64_t arg) {
  if (st().on) st().events.push_back({name, cat, 'X', ts_us, dur_us, -1, arg});
}

void async_begin(const char* name, const char* cat, int64_t id) {
  if (st().on) st().events.push_back({name, cat, 'b', now_us(), 0, id, -1});
}

void async_end(const char* name, const char* cat, int64_t id) {
  if (st().on) st().events.push_back({name, cat, 'e', now_us(), 0, id, -1});
}

std::string stop_and_write(const std::string& path, int rank) {
  st().on = false;
  nlohmann::json events = nlohmann::json::array();
  // Times from the start of the recording: every rank starts it at the same step's beginning,
  // right after the world-wide reduction that ends the step before, so that ranks (on different
  // nodes, whose clocks differ) line up to that reduction's skew.
  const int64_t t0 = st().t0;
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"ts", 0}, {"pid", rank}, {"tid", 0},
                    {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (const Event& e : st().events) {
    nlohmann::json j = {{"name", e.name}, {"cat", e.cat}, {"ph", std::string(1, e.ph)},
                        {"ts", e.ts - t0}, {"pid", rank}, {"tid", 0}};
    if (e.ph == 'X') j["dur"] = e.dur;
    if (e.id >= 0) j["id"] = (int64_t(rank) << 32) | e.id;  // unique over the ranks of a merged file
    if (e.arg >= 0) j["args"] = {{"mb", e.arg}};
    events.push_back(std::move(j));
  }
  st().events.clear();
  std::ofstream out(path, std::ios::trunc);
  if (!out) return "cannot write " + path;
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << '\n';
  out.close();
  if (!out) return "cannot write " + path;
  return "";
}

void comm_enter() {
  if (st().depth++ == 0) st().comm_t0 = now_us();
}

void comm_leave(const char* name, const char* cat) {
  if (--st().depth > 0) return;
  const int64_t t1 = now_us();
  st().comm_us += t1 - st().comm_t0;
  complete(name, cat, st().comm_t0, t1 - st().comm_t0);
}

double comm_blocked_s() { return double(st().comm_us) * 1e-6; }
void reset_comm_blocked() { st().comm_us = 0; }
int64_t next_id() { return ++st().ids; }

}  // namespace fp8moe::trace
