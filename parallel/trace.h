// The step timeline (log.trace) and the exposed-communication clock.
//
// Timeline: while recording, this process keeps Chrome trace events (the JSON format Perfetto and
// chrome://tracing open): complete events ("X") for compute phases (app/stage_runner.cpp's
// forward and backward of each micro-batch, the optimizer) and for every blocking communication
// call (each WatchScope with a group: collectives, pipeline sends and receives, waits), and
// asynchronous pairs ("b" at a non-blocking collective's post, "e" when its wait returns) that
// show what runs behind compute. Each rank writes its own file (pid = rank); scripts/trace.py
// merges them for Perfetto and summarises them.
//
// Exposed communication: the seconds the main thread spends inside outermost communication calls
// (a WatchScope naming a group), counted always (two clock reads per call): communication that
// compute does not hide. A posted collective counts only while its wait blocks.
#pragma once

#include <cstdint>
#include <string>

namespace fp8moe::trace {

bool on();
// Starts recording (drops what an earlier recording kept).
void start();
// Stops recording and writes the events to `path` as {"traceEvents": [...]} with pid `rank`, times
// in microseconds from start(); an error message, or empty on success.
std::string stop_and_write(const std::string& path, int rank);

int64_t now_us();  // microseconds on the steady clock
// name and cat: static strings. arg >= 0 is written as args {"mb": arg} (a micro-batch).
void complete(const char* name, const char* cat, int64_t ts_us, int64_t dur_us, int64_t arg = -1);
void async_begin(const char* name, const char* cat, int64_t id);
void async_end(const char* name, const char* cat, int64_t id);

// A complete event over its lifetime (when recording).
class Span {
 public:
  Span(const char* name, const char* cat, int64_t arg = -1) : name_(name), cat_(cat), arg_(arg), t0_(on() ? now_us() : -1) {}
  ~Span() {
    if (t0_ >= 0 && on()) complete(name_, cat_, t0_, now_us() - t0_, arg_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char *name_, *cat_;
  int64_t arg_, t0_;
};

// The exposed-communication clock (parallel/watchdog.cpp's WatchScope drives it).
void comm_enter();
void comm_leave(const char* name, const char* cat);
double comm_blocked_s();  // since the last reset
void reset_comm_blocked();

// A process-unique id for an asynchronous pair.
int64_t next_id();

}  // namespace fp8moe::trace
