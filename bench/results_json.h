// lynx-bench's --json file: date, GPU, commit and command, then one object per result row. It is
// written whole after every row (to a temporary file, then renamed over it), so that it always parses:
// a run stopped part-way (a trap, memory run out, a time limit) keeps the rows it finished, and says
// "complete": false.
#pragma once

#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace lynx::bench {

// s as a JSON string (quotes and backslashes escaped).
std::string json_string(const std::string& s);

class ResultsJson {
 public:
  // One row's object, streamed into; it joins the file when it goes out of scope.
  class Row {
   public:
    explicit Row(ResultsJson* owner) : owner_(owner) {}
    Row(Row&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)), text_(std::move(other.text_)) {}
    Row(const Row&) = delete;
    Row& operator=(const Row&) = delete;
    Row& operator=(Row&&) = delete;
    ~Row() {
      if (owner_ != nullptr) owner_->add(text_.str());
    }
    template <class T>
    Row& operator<<(const T& v) {
      text_ << v;
      return *this;
    }

   private:
    ResultsJson* owner_;
    std::ostringstream text_;
  };

  // An empty path: no file (enabled() false, rows go nowhere). Otherwise the file is written at once,
  // with no rows: a path that cannot be written fails here (lynx::Error), before any timing.
  ResultsJson(std::string path, const std::string& date, const std::string& gpu, const std::string& commit,
              const std::string& command);
  // Its rows point at it: neither copied nor moved.
  ResultsJson(const ResultsJson&) = delete;
  ResultsJson& operator=(const ResultsJson&) = delete;
  bool enabled() const { return !path_.empty(); }
  Row row() { return Row(enabled() ? this : nullptr); }
  // The file with "complete": true; throws lynx::Error if a write since the last one failed.
  void close();

 private:
  void add(std::string row);  // no throw (a Row's destructor calls it): a failed write is kept for close()
  void write(bool complete) const;

  std::string path_, head_;
  std::vector<std::string> rows_;
  std::string failed_;  // why the last failed write failed ("" when none did)
};

}  // namespace lynx::bench
