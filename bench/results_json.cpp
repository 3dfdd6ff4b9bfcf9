#include "results_json.h"

#include <cstdio>
#include <fstream>

#include "lynx/error.h"

namespace lynx::bench {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

ResultsJson::ResultsJson(std::string path, const std::string& date, const std::string& gpu,
                         const std::string& commit, const std::string& command)
    : path_(std::move(path)) {
  if (path_.empty()) return;
  head_ = "{\n  \"date\": " + json_string(date) + ",\n  \"gpu\": " + json_string(gpu) +
          ",\n  \"commit\": " + json_string(commit) + ",\n  \"command\": " + json_string(command) +
          ",\n  \"results\": [";
  write(false);
}

void ResultsJson::add(std::string row) {
  rows_.push_back(std::move(row));
  try {
    write(false);
  } catch (const Error& e) {
    failed_ = e.what();
  }
}

void ResultsJson::close() {
  if (!enabled()) return;
  if (!failed_.empty()) throw Error("--json", failed_);
  write(true);
  std::printf("results written to %s\n", path_.c_str());
}

void ResultsJson::write(bool complete) const {
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp);
    out << head_;
    for (size_t i = 0; i < rows_.size(); ++i) out << (i > 0 ? ",\n    " : "\n    ") << rows_[i];
    out << "\n  ],\n  \"complete\": " << (complete ? "true" : "false") << "\n}\n";
    if (!out) throw Error("--json", "cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) throw Error("--json", "cannot replace " + path_);
}

}  // namespace lynx::bench
