// A regex (Rust syntax, the subset JSON schemas compile to) -> a trimmed
// DFA over bytes, natively: parse, Thompson NFA over UTF-8 bytes, subset
// construction over byte classes, trim, minimize (Hopcroft), number the
// states breadth-first from the start. `regex_dfa.py` loads it with
// ctypes; `automaton.py` falls back to outlines-core (the plain twin the
// tests compare it with) for every regex this parser does not take.
//
// Semantics follow Rust's regex crate in Unicode mode without flags: a
// class or `.` matches Unicode scalar values (no surrogates), `.` not
// "\n"; `\d`, `\s`, `\w` are Unicode classes whose ranges the caller
// sets (`cw_regex_set_class`, read from outlines-core's own DFAs). The
// whole text must match: `^` first and `$` last are no-ops, elsewhere
// unsupported. Anything else outside the subset (flags, Unicode
// properties, word boundaries, nested classes and class set operations,
// look-around) answers UNSUPPORTED, never a guess.
//
// The C interface: cw_regex_dfa builds and returns a handle (or null with
// a status), cw_regex_dfa_states / _copy / _free read and release it.

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>
#ifdef CW_REGEX_TIMING
#include <chrono>
#include <cstdio>
#define CW_T(name) fprintf(stderr, "%s %.1f ms\n", name, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count())
#else
#define CW_T(name)
#endif

namespace {

enum Status : int32_t {
  kOk = 0,
  kUnsupported = 1,  // outside the subset (or a syntax error)
  kTooManyStates = 2,
  kTooLarge = 3,  // the NFA passed its limit
  kNoMemory = 4,
};

struct Fail {
  Status status;
};

constexpr uint32_t kMaxScalar = 0x10FFFF;

// Sorted, disjoint, non-adjacent ranges of code points.
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

Ranges Normalize(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (auto& x : r) {
    if (!out.empty() && x.first <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, x.second);
    } else {
      out.push_back(x);
    }
  }
  return out;
}

// Every scalar value not in `r` (normalized).
Ranges Negate(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (auto& x : r) {
    if (x.first > next) out.push_back({next, x.first - 1});
    next = x.second + 1;
  }
  if (next <= kMaxScalar) out.push_back({next, kMaxScalar});
  return out;
}

// Without the surrogates, which no UTF-8 text holds.
Ranges Scalars(const Ranges& r) {
  Ranges out;
  for (auto x : r) {
    if (x.second < 0xD800 || x.first > 0xDFFF) {
      out.push_back(x);
      continue;
    }
    if (x.first < 0xD800) out.push_back({x.first, 0xD7FF});
    if (x.second > 0xDFFF) out.push_back({0xE000, x.second});
  }
  return out;
}

Ranges g_classes[3];  // \d, \s, \w (set by the caller)
bool g_class_set[3] = {false, false, false};

// ---------------------------------------------------------------- parse

enum Kind : uint8_t { kSet, kConcat, kAlt, kRepeat };

struct Node {
  Kind kind;
  int32_t set = -1;  // kSet: index into Parser::sets
  int32_t min = 0, max = 0;  // kRepeat; max -1: unbounded
  std::vector<int32_t> kids;
};

class Parser {
 public:
  Parser(const char* text, size_t n) : s_(text), n_(n) {}

  int32_t Parse() {
    if (i_ < n_ && s_[i_] == '^') ++i_;
    int32_t root = Alternation(0);
    if (i_ < n_ && s_[i_] == '$' && i_ + 1 == n_) ++i_;
    if (i_ != n_) throw Fail{kUnsupported};
    return root;
  }

  std::vector<Node> nodes;
  std::vector<Ranges> sets;

 private:
  int32_t Add(Node node) {
    nodes.push_back(std::move(node));
    return static_cast<int32_t>(nodes.size() - 1);
  }

  int32_t SetNode(Ranges r) {
    sets.push_back(Normalize(Scalars(r)));
    Node node{kSet};
    node.set = static_cast<int32_t>(sets.size() - 1);
    return Add(std::move(node));
  }

  int32_t Alternation(int depth) {
    if (depth > 2000) throw Fail{kUnsupported};
    std::vector<int32_t> branches{Concatenation(depth)};
    while (i_ < n_ && s_[i_] == '|') {
      ++i_;
      branches.push_back(Concatenation(depth));
    }
    if (branches.size() == 1) return branches[0];
    Node node{kAlt};
    node.kids = std::move(branches);
    return Add(std::move(node));
  }

  int32_t Concatenation(int depth) {
    Node node{kConcat};
    while (i_ < n_ && s_[i_] != '|' && s_[i_] != ')' &&
           !(s_[i_] == '$' && i_ + 1 == n_)) {
      int32_t atom = Atom(depth);
      atom = Quantified(atom);
      node.kids.push_back(atom);
    }
    return Add(std::move(node));
  }

  int32_t Quantified(int32_t atom) {
    if (i_ >= n_) return atom;
    int32_t lo, hi;
    char c = s_[i_];
    if (c == '*') {
      lo = 0, hi = -1, ++i_;
    } else if (c == '+') {
      lo = 1, hi = -1, ++i_;
    } else if (c == '?') {
      lo = 0, hi = 1, ++i_;
    } else if (c == '{') {
      ++i_;
      lo = Number();
      hi = lo;
      if (i_ < n_ && s_[i_] == ',') {
        ++i_;
        hi = (i_ < n_ && s_[i_] == '}') ? -1 : Number();
      }
      if (i_ >= n_ || s_[i_] != '}') throw Fail{kUnsupported};
      ++i_;
      if (hi >= 0 && hi < lo) throw Fail{kUnsupported};
    } else {
      return atom;
    }
    if (i_ < n_ && s_[i_] == '?') ++i_;  // lazy: the same language
    if (i_ < n_ && (s_[i_] == '*' || s_[i_] == '+' || s_[i_] == '?' ||
                    s_[i_] == '{')) {
      throw Fail{kUnsupported};  // stacked repetitions
    }
    Node node{kRepeat};
    node.min = lo, node.max = hi;
    node.kids.push_back(atom);
    return Add(std::move(node));
  }

  int32_t Number() {
    size_t start = i_;
    int64_t v = 0;
    while (i_ < n_ && s_[i_] >= '0' && s_[i_] <= '9') {
      v = v * 10 + (s_[i_] - '0');
      if (v > 1000000) throw Fail{kTooLarge};
      ++i_;
    }
    if (i_ == start) throw Fail{kUnsupported};
    return static_cast<int32_t>(v);
  }

  int32_t Atom(int depth) {
    char c = s_[i_];
    switch (c) {
      case '(': {
        ++i_;
        if (i_ < n_ && s_[i_] == '?') {
          if (i_ + 1 < n_ && s_[i_ + 1] == ':') {
            i_ += 2;
          } else if (i_ + 1 < n_ && (s_[i_ + 1] == 'P' || s_[i_ + 1] == '<')) {
            i_ += s_[i_ + 1] == 'P' ? 2 : 1;
            if (i_ >= n_ || s_[i_] != '<') throw Fail{kUnsupported};
            ++i_;
            size_t start = i_;
            while (i_ < n_ && (isalnum(static_cast<unsigned char>(s_[i_])) ||
                               s_[i_] == '_' || s_[i_] == '.' ||
                               s_[i_] == '[' || s_[i_] == ']')) {
              ++i_;
            }
            if (i_ == start || i_ >= n_ || s_[i_] != '>') {
              throw Fail{kUnsupported};
            }
            ++i_;
          } else {
            throw Fail{kUnsupported};  // flags, look-around
          }
        }
        int32_t inner = Alternation(depth + 1);
        if (i_ >= n_ || s_[i_] != ')') throw Fail{kUnsupported};
        ++i_;
        return inner;
      }
      case '[':
        return SetNode(Class());
      case '.':
        ++i_;
        return SetNode(Negate({{'\n', '\n'}}));
      case '\\':
        return SetNode(Escape(false));
      case '*':
      case '+':
      case '?':
      case '{':
      case '}':
      case ']':
      case '^':
      case '$':
        throw Fail{kUnsupported};
      default: {
        uint32_t cp = Char();
        return SetNode({{cp, cp}});
      }
    }
  }

  // One UTF-8 character of the text.
  uint32_t Char() {
    unsigned char b = static_cast<unsigned char>(s_[i_]);
    int len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    if (b >= 0x80 && b < 0xC0) throw Fail{kUnsupported};
    if (i_ + len > n_) throw Fail{kUnsupported};
    uint32_t cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F)
                                                                   : (b & 0x07);
    for (int k = 1; k < len; ++k) {
      unsigned char t = static_cast<unsigned char>(s_[i_ + k]);
      if ((t & 0xC0) != 0x80) throw Fail{kUnsupported};
      cp = (cp << 6) | (t & 0x3F);
    }
    i_ += len;
    return cp;
  }

  uint32_t Hex(size_t digits) {
    uint32_t v = 0;
    size_t start = i_;
    while (i_ < n_ && (digits == 0 || i_ - start < digits) &&
           isxdigit(static_cast<unsigned char>(s_[i_]))) {
      char h = s_[i_];
      v = v * 16 + (h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
      if (v > kMaxScalar) throw Fail{kUnsupported};
      ++i_;
    }
    if (i_ == start || (digits && i_ - start != digits)) {
      throw Fail{kUnsupported};
    }
    return v;
  }

  // `\` and what follows it: a set of code points. `in_class`: inside
  // [...] (the same escapes).
  Ranges Escape(bool in_class) {
    ++i_;
    if (i_ >= n_) throw Fail{kUnsupported};
    char c = s_[i_];
    auto one = [](uint32_t cp) { return Ranges{{cp, cp}}; };
    switch (c) {
      case 'n': ++i_; return one('\n');
      case 't': ++i_; return one('\t');
      case 'r': ++i_; return one('\r');
      case 'f': ++i_; return one('\f');
      case 'v': ++i_; return one('\v');
      case 'a': ++i_; return one('\a');
      case 'x':
      case 'u':
      case 'U': {
        ++i_;
        uint32_t cp;
        if (i_ < n_ && s_[i_] == '{') {
          ++i_;
          cp = Hex(0);
          if (i_ >= n_ || s_[i_] != '}') throw Fail{kUnsupported};
          ++i_;
        } else {
          cp = Hex(c == 'x' ? 2 : c == 'u' ? 4 : 8);
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) throw Fail{kUnsupported};
        return one(cp);
      }
      case 'd':
      case 's':
      case 'w':
      case 'D':
      case 'S':
      case 'W': {
        int k = (c | 0x20) == 'd' ? 0 : (c | 0x20) == 's' ? 1 : 2;
        if (!g_class_set[k]) throw Fail{kUnsupported};
        ++i_;
        return c >= 'a' ? g_classes[k] : Negate(g_classes[k]);
      }
      default:
        break;
    }
    unsigned char u = static_cast<unsigned char>(c);
    // An escaped ASCII punctuation character is itself.
    if (u < 0x80 && ispunct(u) && c != '<' && c != '>') {
      ++i_;
      return one(u);
    }
    (void)in_class;
    throw Fail{kUnsupported};
  }

  // [...]: a set of code points.
  Ranges Class() {
    ++i_;
    bool negated = false;
    if (i_ < n_ && s_[i_] == '^') negated = true, ++i_;
    Ranges out;
    bool first = true;
    while (true) {
      if (i_ >= n_) throw Fail{kUnsupported};
      char c = s_[i_];
      if (c == ']' && !first) {
        ++i_;
        break;
      }
      if (c == '[') throw Fail{kUnsupported};  // nested, [:alpha:]
      if ((c == '&' || c == '-' || c == '~') && i_ + 1 < n_ &&
          s_[i_ + 1] == c) {
        throw Fail{kUnsupported};  // set operations
      }
      Ranges item = Item(first);
      first = false;
      // a range a-b (a "-" before "]" is itself)
      if (item.size() == 1 && item[0].first == item[0].second &&
          i_ + 1 < n_ && s_[i_] == '-' && s_[i_ + 1] != ']') {
        ++i_;
        if (s_[i_] == '[') throw Fail{kUnsupported};
        Ranges end = Item(false);
        if (end.size() != 1 || end[0].first != end[0].second ||
            end[0].first < item[0].first) {
          throw Fail{kUnsupported};
        }
        item = {{item[0].first, end[0].first}};
      }
      out.insert(out.end(), item.begin(), item.end());
    }
    out = Normalize(out);
    return negated ? Negate(out) : out;
  }

  Ranges Item(bool first) {
    (void)first;
    if (s_[i_] == '\\') return Escape(true);
    uint32_t cp = Char();
    return {{cp, cp}};
  }

  const char* s_;
  size_t n_;
  size_t i_ = 0;
};

// ------------------------------------------------------------------ NFA

enum NKind : uint8_t { kByte, kSplit, kEps, kMatch };

struct NState {
  NKind kind;
  uint8_t lo, hi;
  int32_t out, out1;
};

// UTF-8 byte-range sequences of a range of scalar values (no surrogates):
// each a list of (lo, hi) per byte.
struct Seq {
  int n;
  uint8_t lo[4], hi[4];
};

int Encode(uint32_t cp, uint8_t* b) {
  if (cp < 0x80) return b[0] = cp, 1;
  if (cp < 0x800) {
    b[0] = 0xC0 | (cp >> 6), b[1] = 0x80 | (cp & 0x3F);
    return 2;
  }
  if (cp < 0x10000) {
    b[0] = 0xE0 | (cp >> 12), b[1] = 0x80 | ((cp >> 6) & 0x3F);
    b[2] = 0x80 | (cp & 0x3F);
    return 3;
  }
  b[0] = 0xF0 | (cp >> 18), b[1] = 0x80 | ((cp >> 12) & 0x3F);
  b[2] = 0x80 | ((cp >> 6) & 0x3F), b[3] = 0x80 | (cp & 0x3F);
  return 4;
}

void Utf8Seqs(uint32_t lo, uint32_t hi, std::vector<Seq>& out) {
  std::vector<std::pair<uint32_t, uint32_t>> stack{{lo, hi}};
  std::vector<Seq> found;
  while (!stack.empty()) {
    auto [a, b] = stack.back();
    stack.pop_back();
    bool split = false;
    // ranges of one encoded length
    for (uint32_t edge : {0x7Fu, 0x7FFu, 0xFFFFu}) {
      if (a <= edge && b > edge) {
        stack.push_back({edge + 1, b});
        stack.push_back({a, edge});
        split = true;
        break;
      }
    }
    if (split) continue;
    uint8_t ea[4], eb[4];
    int n = Encode(a, ea);
    Encode(b, eb);
    for (int k = 1; k < n && !split; ++k) {
      uint32_t m = (1u << (6 * k)) - 1;
      if ((a & ~m) != (b & ~m)) {
        if ((a & m) != 0) {
          stack.push_back({(a | m) + 1, b});
          stack.push_back({a, a | m});
          split = true;
        } else if ((b & m) != m) {
          stack.push_back({b & ~m, b});
          stack.push_back({a, (b & ~m) - 1});
          split = true;
        }
      }
    }
    if (split) continue;
    Seq s{n, {}, {}};
    for (int k = 0; k < n; ++k) s.lo[k] = ea[k], s.hi[k] = eb[k];
    found.push_back(s);
  }
  out.insert(out.end(), found.begin(), found.end());
}

class Nfa {
 public:
  Nfa(const Parser& p, int64_t max_states) : p_(p), max_(max_states) {
    seqs_.resize(p.sets.size());
    done_.assign(p.sets.size(), false);
  }

  int32_t New(NKind k, uint8_t lo, uint8_t hi, int32_t out, int32_t out1) {
    if (static_cast<int64_t>(states.size()) >= max_) throw Fail{kTooLarge};
    states.push_back({k, lo, hi, out, out1});
    return static_cast<int32_t>(states.size() - 1);
  }

  // The states of `node` followed by `next`; returns its start.
  int32_t Compile(int32_t id, int32_t next) {
    const Node& node = p_.nodes[id];
    switch (node.kind) {
      case kSet: {
        const std::vector<Seq>& seqs = Seqs(node.set);
        if (seqs.empty()) return New(kByte, 1, 0, next, -1);  // nothing
        return Trie(seqs, 0, seqs.size(), 0, next);
      }
      case kConcat: {
        int32_t at = next;
        for (size_t k = node.kids.size(); k-- > 0;) at = Compile(node.kids[k], at);
        return at;
      }
      case kAlt: {
        int32_t start = -1;
        for (size_t k = node.kids.size(); k-- > 0;) {
          int32_t branch = Compile(node.kids[k], next);
          start = start < 0 ? branch : New(kSplit, 0, 0, branch, start);
        }
        return start;
      }
      case kRepeat: {
        int32_t kid = node.kids[0];
        int32_t at = next;
        if (node.max < 0) {
          int32_t loop = New(kSplit, 0, 0, -1, next);
          states[loop].out = Compile(kid, loop);
          at = loop;
        } else {
          for (int32_t k = node.min; k < node.max; ++k) {
            at = New(kSplit, 0, 0, Compile(kid, at), next);
          }
        }
        for (int32_t k = 0; k < node.min; ++k) at = Compile(kid, at);
        return at;
      }
    }
    return next;
  }

  std::vector<NState> states;

 private:
  // seqs[from, to) (sorted; equal up to byte `level`) as a trie of byte
  // states: one state per distinct range at each level, so a class's
  // alternatives start with at most as many states as lead-byte ranges.
  int32_t Trie(const std::vector<Seq>& seqs, size_t from, size_t to,
               int level, int32_t next) {
    int32_t start = -1;
    size_t i = from;
    std::vector<int32_t> heads;
    while (i < to) {
      size_t j = i + 1;
      while (j < to && seqs[j].lo[level] == seqs[i].lo[level] &&
             seqs[j].hi[level] == seqs[i].hi[level]) {
        ++j;
      }
      int32_t out = level + 1 == seqs[i].n ? next
                                           : Trie(seqs, i, j, level + 1, next);
      heads.push_back(New(kByte, seqs[i].lo[level], seqs[i].hi[level], out, -1));
      i = j;
    }
    for (size_t k = heads.size(); k-- > 0;) {
      start = start < 0 ? heads[k] : New(kSplit, 0, 0, heads[k], start);
    }
    return start;
  }

  const std::vector<Seq>& Seqs(int32_t set) {
    if (!done_[set]) {
      for (auto& r : p_.sets[set]) Utf8Seqs(r.first, r.second, seqs_[set]);
      done_[set] = true;
    }
    return seqs_[set];
  }

  const Parser& p_;
  int64_t max_;
  std::vector<std::vector<Seq>> seqs_;
  std::vector<bool> done_;
};

// ------------------------------------------------------------------ DFA

// A DFA over byte classes: `table` [n, nc] (-1: rejected), `cls` each
// byte's class; written out over bytes by `cw_regex_dfa_copy`.
struct Dfa {
  int32_t n = 0;
  int nc = 1;
  std::vector<int32_t> table;
  std::vector<uint8_t> final;
  uint8_t cls[256] = {};
};

// Sets of int32 kept end to end, each found again by its contents (open
// addressing on a 64-bit hash): set k is pool[start[k], start[k + 1]).
class SetTable {
 public:
  SetTable() : slots_(1024, -1), hashes_(1024, 0) { start_.push_back(0); }

  // The number of `v` (sorted), added as the next one if new; `*added`
  // says which.
  int32_t Find(const std::vector<int32_t>& v, bool* added) {
    uint64_t h = Hash(v);
    size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      int32_t k = slots_[i];
      if (k < 0) {
        *added = true;
        k = Size();
        slots_[i] = k, hashes_[i] = h;
        pool_.insert(pool_.end(), v.begin(), v.end());
        start_.push_back(static_cast<int64_t>(pool_.size()));
        if (2 * static_cast<size_t>(Size()) > slots_.size()) Grow();
        return k;
      }
      if (hashes_[i] == h && Equal(k, v)) {
        *added = false;
        return k;
      }
    }
  }

  int32_t Size() const { return static_cast<int32_t>(start_.size() - 1); }
  const int32_t* Begin(int32_t k) const { return pool_.data() + start_[k]; }
  const int32_t* End(int32_t k) const { return pool_.data() + start_[k + 1]; }

 private:
  static uint64_t Hash(const std::vector<int32_t>& v) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ v.size();
    for (int32_t x : v) {
      h ^= static_cast<uint32_t>(x);
      h *= 0xFF51AFD7ED558CCDull;
      h ^= h >> 32;
    }
    return h;
  }

  bool Equal(int32_t k, const std::vector<int32_t>& v) const {
    return End(k) - Begin(k) == static_cast<int64_t>(v.size()) &&
           std::equal(v.begin(), v.end(), Begin(k));
  }

  void Grow() {
    std::vector<int32_t> slots(slots_.size() * 2, -1);
    std::vector<uint64_t> hashes(slots.size(), 0);
    size_t mask = slots.size() - 1;
    for (size_t j = 0; j < slots_.size(); ++j) {
      if (slots_[j] < 0) continue;
      size_t i = hashes_[j] & mask;
      while (slots[i] >= 0) i = (i + 1) & mask;
      slots[i] = slots_[j], hashes[i] = hashes_[j];
    }
    slots_.swap(slots), hashes_.swap(hashes);
  }

  std::vector<int32_t> slots_;
  std::vector<uint64_t> hashes_;
  std::vector<int32_t> pool_;
  std::vector<int64_t> start_;
};

// Subset construction over byte classes: DFA state k is the k-th set of
// NFA byte and match states (closed under the empty moves).
class Subsets {
 public:
  Subsets(const Nfa& nfa, int64_t max_states)
      : nfa_(nfa), max_(max_states), stamp_(nfa.states.size(), 0) {
    // byte classes: bytes no NFA range tells apart share one
    std::vector<uint8_t> edge(257, 0);
    for (auto& s : nfa.states) {
      if (s.kind == kByte && s.lo <= s.hi) edge[s.lo] = 1, edge[s.hi + 1] = 1;
    }
    int c = -1;
    for (int b = 0; b < 256; ++b) {
      if (b == 0 || edge[b]) ++c;
      cls[b] = static_cast<uint8_t>(c);
    }
    nc = c + 1;
  }

  // From the NFA's `start`; `match`: its match state.
  void Run(int32_t start, int32_t match) {
    match_ = match;
    std::vector<int32_t> seed{start};
    Closure(seed);
    Intern();
    std::vector<std::vector<int32_t>> buckets(nc);
    std::vector<int> used;
    for (int32_t d = 0; d < sets_.Size(); ++d) {
      for (const int32_t* p = sets_.Begin(d); p != sets_.End(d); ++p) {
        const NState& s = nfa_.states[*p];
        if (s.kind != kByte || s.lo > s.hi) continue;
        for (int c = cls[s.lo]; c <= cls[s.hi]; ++c) {
          if (buckets[c].empty()) used.push_back(c);
          buckets[c].push_back(s.out);
        }
      }
      size_t row = trans.size();
      trans.resize(row + nc, -1);
      for (int c : used) {
        std::vector<int32_t>& seeds = buckets[c];
        std::sort(seeds.begin(), seeds.end());
        seeds.erase(std::unique(seeds.begin(), seeds.end()), seeds.end());
        trans[row + c] = Memo(seeds);
        seeds.clear();
      }
      used.clear();
    }
  }

  int32_t States() const { return sets_.Size(); }

  uint8_t cls[256];
  int nc = 0;
  std::vector<int32_t> trans;  // [states, classes], -1: none
  std::vector<uint8_t> final;

 private:
  // The DFA state of the closure of `seeds` (sorted, distinct); each set
  // of seeds is closed once, as classes and states that lead to the same
  // NFA states share the work.
  int32_t Memo(const std::vector<int32_t>& seeds) {
    bool added;
    int32_t k = seeds_.Find(seeds, &added);
    if (!added) return of_seeds_[k];
    Closure(seeds);
    int32_t d = Intern();
    of_seeds_.push_back(d);
    return d;
  }

  // current_ = the closure's byte and match states, sorted.
  void Closure(const std::vector<int32_t>& seeds) {
    ++tick_;
    current_.clear();
    stack_.assign(seeds.begin(), seeds.end());
    while (!stack_.empty()) {
      int32_t s = stack_.back();
      stack_.pop_back();
      if (stamp_[s] == tick_) continue;
      stamp_[s] = tick_;
      const NState& st = nfa_.states[s];
      switch (st.kind) {
        case kByte:
        case kMatch:
          current_.push_back(s);
          break;
        case kSplit:
          stack_.push_back(st.out1);
          stack_.push_back(st.out);
          break;
        case kEps:
          stack_.push_back(st.out);
          break;
      }
    }
    std::sort(current_.begin(), current_.end());
  }

  int32_t Intern() {
    if (current_.empty()) return -1;
    bool added;
    int32_t d = sets_.Find(current_, &added);
    if (added) {
      if (d >= max_) throw Fail{kTooManyStates};
      final.push_back(std::binary_search(current_.begin(), current_.end(),
                                         match_));
    }
    return d;
  }

  const Nfa& nfa_;
  int64_t max_;
  int32_t match_ = -1;
  std::vector<uint32_t> stamp_;
  uint32_t tick_ = 0;
  std::vector<int32_t> stack_, current_;
  SetTable sets_, seeds_;
  std::vector<int32_t> of_seeds_;
};

// A DFA's transitions by target: state t's incoming ones are
// source[head[t], head[t + 1]) on label[...].
struct Incoming {
  Incoming(const std::vector<int32_t>& trans, int32_t n, int nc)
      : head(n + 1, 0) {
    for (int64_t k = 0; k < static_cast<int64_t>(n) * nc; ++k) {
      if (trans[k] >= 0) ++head[trans[k] + 1];
    }
    for (int32_t s = 0; s < n; ++s) head[s + 1] += head[s];
    source.resize(head[n]);
    label.resize(head[n]);
    std::vector<int64_t> fill(head.begin(), head.end() - 1);
    for (int32_t s = 0; s < n; ++s) {
      const int32_t* row = &trans[static_cast<int64_t>(s) * nc];
      for (int c = 0; c < nc; ++c) {
        if (row[c] >= 0) source[fill[row[c]]] = s, label[fill[row[c]]++] = c;
      }
    }
  }
  std::vector<int64_t> head;
  std::vector<int32_t> source;
  std::vector<uint8_t> label;
};

// Whether each state reaches a final one.
std::vector<uint8_t> Live(const Incoming& in, const std::vector<uint8_t>& final,
                          int32_t n) {
  std::vector<uint8_t> live(n, 0);
  std::vector<int32_t> stack;
  for (int32_t s = 0; s < n; ++s) {
    if (final[s]) live[s] = 1, stack.push_back(s);
  }
  while (!stack.empty()) {
    int32_t t = stack.back();
    stack.pop_back();
    for (int64_t k = in.head[t]; k < in.head[t + 1]; ++k) {
      int32_t s = in.source[k];
      if (!live[s]) live[s] = 1, stack.push_back(s);
    }
  }
  return live;
}

// Hopcroft's partition refinement: the block of each state. The states
// that reach no final state start in one block with the implicit sink of
// missing transitions; it is the one block never used as a splitter (all
// blocks but one start on the worklist, and any one can be left out), so
// its many incoming transitions are never walked, and it never splits
// (its states lead only to it). A splitter is a block with all its
// classes at once (whether a block waits is the same for every class, so
// the "smaller half" rule is Hopcroft's): O(transitions x log states).
// Returns the blocks; `*dead` is the dead states' block (-1: none).
std::vector<int32_t> Minimize(const Incoming& in,
                              const std::vector<uint8_t>& final,
                              const std::vector<uint8_t>& live, int32_t n,
                              int nc, int32_t* dead) {
  std::vector<int32_t> elem(n), where(n), block(n);
  std::vector<int32_t> first, last, marked;
  std::vector<uint8_t> waiting;
  std::vector<int32_t> work;
  *dead = -1;
  int32_t k = 0;
  for (int pass = 0; pass < 3; ++pass) {  // final, other live, dead
    int32_t begin = k;
    for (int32_t s = 0; s < n; ++s) {
      int group = !live[s] ? 2 : final[s] ? 0 : 1;
      if (group == pass) elem[k] = s, where[s] = k, ++k;
    }
    if (k == begin) continue;
    int32_t b = static_cast<int32_t>(first.size());
    for (int32_t j = begin; j < k; ++j) block[elem[j]] = b;
    first.push_back(begin), last.push_back(k), marked.push_back(0);
    waiting.push_back(pass < 2);
    if (pass < 2) work.push_back(b);
    if (pass == 2) *dead = b;
  }
  std::vector<int32_t> touched, count(nc + 1), fill(nc), by_class;
  while (!work.empty()) {
    int32_t a = work.back();
    work.pop_back();
    waiting[a] = 0;
    // the splitter's incoming transitions, grouped by class
    std::fill(count.begin(), count.end(), 0);
    for (int32_t j = first[a]; j < last[a]; ++j) {
      int32_t t = elem[j];
      for (int64_t i = in.head[t]; i < in.head[t + 1]; ++i) {
        ++count[in.label[i] + 1];
      }
    }
    for (int c = 0; c < nc; ++c) count[c + 1] += count[c];
    by_class.resize(count[nc]);
    std::copy(count.begin(), count.end() - 1, fill.begin());
    for (int32_t j = first[a]; j < last[a]; ++j) {
      int32_t t = elem[j];
      for (int64_t i = in.head[t]; i < in.head[t + 1]; ++i) {
        by_class[fill[in.label[i]]++] = in.source[i];
      }
    }
    for (int c = 0; c < nc; ++c) {
      for (int32_t i = count[c]; i < count[c + 1]; ++i) {
        int32_t s = by_class[i];
        int32_t b = block[s];
        int32_t pos = where[s];
        int32_t mark_end = first[b] + marked[b];
        if (pos < mark_end) continue;  // marked already
        if (marked[b] == 0) touched.push_back(b);
        int32_t other = elem[mark_end];
        elem[pos] = other, where[other] = pos;
        elem[mark_end] = s, where[s] = mark_end;
        ++marked[b];
      }
      for (int32_t b : touched) {
        int32_t size = last[b] - first[b];
        int32_t m = marked[b];
        marked[b] = 0;
        if (m == size) continue;
        // the marked part becomes a new block
        int32_t nb = static_cast<int32_t>(first.size());
        first.push_back(first[b]), last.push_back(first[b] + m);
        marked.push_back(0), waiting.push_back(0);
        first[b] += m;
        for (int32_t j = first[nb]; j < last[nb]; ++j) block[elem[j]] = nb;
        if (waiting[b] || m <= size - m) {
          waiting[nb] = 1, work.push_back(nb);
        } else {
          waiting[b] = 1, work.push_back(b);
        }
      }
      touched.clear();
    }
  }
  return block;
}

// The minimal DFA over bytes of a DFA over byte classes (`trans`:
// [n, nc], -1: none; state 0 the start; every state reached from it):
// the states that reach no final state dropped, the rest minimized and
// numbered breadth-first from the start.
Dfa Finish(const std::vector<int32_t>& trans, const std::vector<uint8_t>& final,
           int32_t n, int nc, const uint8_t* cls) {
#ifdef CW_REGEX_TIMING
  auto t0 = std::chrono::steady_clock::now();
#endif
  Incoming in(trans, n, nc);
  std::vector<uint8_t> live = Live(in, final, n);
  CW_T("live");
  Dfa out;
  if (!live[0]) {  // nothing matches
    out.n = 1;
    out.table.assign(1, -1);
    out.final.assign(1, 0);
    return out;
  }
  int32_t dead;
  std::vector<int32_t> block = Minimize(in, final, live, n, nc, &dead);
  CW_T("minimize");
  // the blocks numbered breadth-first from the start's, each read from
  // its first state
  std::vector<int32_t> number(n, -1), rep(n, -1);
  for (int32_t s = n - 1; s >= 0; --s) rep[block[s]] = s;
  std::vector<int32_t> order{block[0]};
  number[block[0]] = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const int32_t* row = &trans[static_cast<int64_t>(rep[order[k]]) * nc];
    for (int c = 0; c < nc; ++c) {
      if (row[c] < 0) continue;
      int32_t b = block[row[c]];
      if (b != dead && number[b] < 0) {
        number[b] = static_cast<int32_t>(order.size());
        order.push_back(b);
      }
    }
  }
  out.n = static_cast<int32_t>(order.size());
  out.nc = nc;
  std::copy(cls, cls + 256, out.cls);
  out.table.resize(static_cast<int64_t>(out.n) * nc);
  out.final.assign(out.n, 0);
  for (int32_t k = 0; k < out.n; ++k) {
    int32_t s = rep[order[k]];
    out.final[k] = final[s];
    const int32_t* row = &trans[static_cast<int64_t>(s) * nc];
    int32_t* to = &out.table[static_cast<int64_t>(k) * nc];
    for (int c = 0; c < nc; ++c) {
      int32_t t = row[c];
      to[c] = t < 0 || block[t] == dead ? -1 : number[block[t]];
    }
  }
  CW_T("out");
  return out;
}

// The minimal DFA of a DFA over bytes (`table`: [n, 256], -1: rejected)
// from `start`: its states reached from there, over the byte classes no
// column tells apart, through `Finish`.
Dfa MinimizeTable(const int32_t* table, const uint8_t* final, int32_t n,
                  int32_t start) {
  if (start < 0 || start >= n) throw Fail{kUnsupported};
  std::vector<int32_t> number(n, -1), order{start};
  number[start] = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const int32_t* row = &table[static_cast<int64_t>(order[k]) * 256];
    for (int b = 0; b < 256; ++b) {
      int32_t t = row[b];
      if (t >= n) throw Fail{kUnsupported};
      if (t >= 0 && number[t] < 0) {
        number[t] = static_cast<int32_t>(order.size());
        order.push_back(t);
      }
    }
  }
  const int32_t m = static_cast<int32_t>(order.size());
  // byte classes: equal columns over the reached states
  uint64_t hash[256];
  for (int b = 0; b < 256; ++b) hash[b] = 0x9E3779B97F4A7C15ull;
  for (int32_t s : order) {
    const int32_t* row = &table[static_cast<int64_t>(s) * 256];
    for (int b = 0; b < 256; ++b) {
      hash[b] = (hash[b] ^ static_cast<uint32_t>(row[b] + 1)) *
                0xFF51AFD7ED558CCDull;
    }
  }
  uint8_t cls[256];
  int rep[256];
  int nc = 0;
  for (int b = 0; b < 256; ++b) {
    int c = 0;
    while (c < nc && hash[rep[c]] != hash[b]) ++c;
    if (c == nc) rep[nc++] = b;
    cls[b] = static_cast<uint8_t>(c);
  }
  // the columns a hash put together are equal (read row by row)
  for (int32_t s : order) {
    const int32_t* row = &table[static_cast<int64_t>(s) * 256];
    for (int b = 0; b < 256; ++b) {
      if (row[b] != row[rep[cls[b]]]) throw Fail{kUnsupported};
    }
  }
  std::vector<int32_t> trans(static_cast<int64_t>(m) * nc);
  std::vector<uint8_t> fin(m);
  for (int32_t k = 0; k < m; ++k) {
    const int32_t* row = &table[static_cast<int64_t>(order[k]) * 256];
    fin[k] = final[order[k]];
    for (int c = 0; c < nc; ++c) {
      int32_t t = row[rep[c]];
      trans[static_cast<int64_t>(k) * nc + c] = t < 0 ? -1 : number[t];
    }
  }
  return Finish(trans, fin, m, nc, cls);
}

Dfa Build(const char* regex, size_t len, int64_t max_states,
          int64_t max_nfa) {
#ifdef CW_REGEX_TIMING
  auto t0 = std::chrono::steady_clock::now();
#endif
  Parser parser(regex, len);
  int32_t root = parser.Parse();
  CW_T("parse");
  Nfa nfa(parser, max_nfa);
  int32_t match = nfa.New(kMatch, 0, 0, -1, -1);
  int32_t start = nfa.Compile(root, match);
  parser.nodes.clear();
  parser.nodes.shrink_to_fit();
  CW_T("nfa");
  Subsets sub(nfa, max_states);
  sub.Run(start, match);
  CW_T("subsets");
  const int nc = sub.nc;
  const int32_t n = sub.States();
#ifdef CW_REGEX_TIMING
  fprintf(stderr, "nfa %zu dfa %d classes %d\n", nfa.states.size(), n, nc);
#endif
  Dfa out = Finish(sub.trans, sub.final, n, nc, sub.cls);
  CW_T("out");
  return out;
}

// Budget forcing's distances (`lazy.token_distance`, its NumPy twin):
// for each state, the fewest tokens that spell its path of bytes to a
// final state, where each state's path is its shortest one by the
// smallest byte, continued by the next state's. `keys`/`nodes`: the
// trie's children sorted (`Trie.children`), `spells`: the nodes some
// allowed token ends at; `forced_ids`/`forced_end` (or null): a state
// whose id is set counts only the pair its forced token makes.
void TokenDistance(const int32_t* table, const uint8_t* final, int32_t n,
                   const int64_t* keys, const int64_t* nodes, int64_t nkeys,
                   const uint8_t* spells, const int32_t* forced_ids,
                   const int32_t* forced_end, int32_t dead, int32_t* out) {
  // bytes to a final state: breadth-first, backwards
  std::vector<int64_t> head(n + 1, 0);
  for (int64_t k = 0; k < static_cast<int64_t>(n) * 256; ++k) {
    if (table[k] >= 0) ++head[table[k] + 1];
  }
  for (int32_t s = 0; s < n; ++s) head[s + 1] += head[s];
  std::vector<int32_t> from(head[n]);
  {
    std::vector<int64_t> fill(head.begin(), head.end() - 1);
    for (int32_t s = 0; s < n; ++s) {
      for (int b = 0; b < 256; ++b) {
        int32_t t = table[static_cast<int64_t>(s) * 256 + b];
        if (t >= 0) from[fill[t]++] = s;
      }
    }
  }
  std::vector<int32_t> bytes_to(n, dead), order;
  for (int32_t s = 0; s < n; ++s) {
    if (final[s]) bytes_to[s] = 0, order.push_back(s);
  }
  for (size_t k = 0; k < order.size(); ++k) {
    int32_t t = order[k];
    for (int64_t i = head[t]; i < head[t + 1]; ++i) {
      if (bytes_to[from[i]] == dead) {
        bytes_to[from[i]] = bytes_to[t] + 1;
        order.push_back(from[i]);
      }
    }
  }
  // each state's next byte along its path, and the state after it
  std::vector<int32_t> first(n, 0), after(n, -1);
  for (int32_t s = 0; s < n; ++s) {
    if (bytes_to[s] == dead || final[s]) continue;
    const int32_t* row = &table[static_cast<int64_t>(s) * 256];
    for (int b = 0; b < 256; ++b) {
      if (row[b] >= 0 && bytes_to[row[b]] == bytes_to[s] - 1) {
        first[s] = b, after[s] = row[b];
        break;
      }
    }
  }
  for (int32_t s = 0; s < n; ++s) out[s] = final[s] ? 0 : dead;
  // by increasing distance (`order`: breadth-first), each state's best
  // token: its path walked down the trie
  for (int32_t s : order) {
    if (final[s]) continue;
    int32_t best = dead;
    int64_t node = -1;
    int32_t at = s;
    while (true) {
      int64_t key = (node + 1) * 256 + first[at];
      const int64_t* it = std::lower_bound(keys, keys + nkeys, key);
      if (it == keys + nkeys || *it != key) break;
      node = nodes[it - keys];
      at = after[at];
      bool counted = !forced_ids || forced_ids[s] < 0 || forced_end[s] == at;
      if (spells[node] && counted && out[at] < dead) {
        best = std::min(best, out[at] + 1);
      }
      if (final[at]) break;
    }
    out[s] = best;
  }
}

}  // namespace

extern "C" {

// Sets \d (0), \s (1) or \w (2): `n` ranges as pairs of code points.
__attribute__((visibility("default"))) void cw_regex_set_class(
    int32_t which, const uint32_t* pairs, int64_t n) {
  Ranges r;
  for (int64_t k = 0; k < n; ++k) r.push_back({pairs[2 * k], pairs[2 * k + 1]});
  g_classes[which] = Normalize(r);
  g_class_set[which] = true;
}

// The DFA of `regex` (UTF-8, `len` bytes), or null with `*status` set.
__attribute__((visibility("default"))) void* cw_regex_dfa(
    const char* regex, int64_t len, int64_t max_states, int64_t max_nfa,
    int32_t* status) {
  try {
    Dfa* dfa = new Dfa(Build(regex, static_cast<size_t>(len), max_states,
                             max_nfa));
    *status = kOk;
    return dfa;
  } catch (const Fail& f) {
    *status = f.status;
  } catch (const std::bad_alloc&) {
    *status = kNoMemory;
  } catch (const std::length_error&) {
    *status = kNoMemory;
  }
  return nullptr;
}

// The minimal DFA of a DFA over bytes (`table`: int32[n, 256], -1:
// rejected; `final`: uint8[n]) from `start`, or null with `*status` set.
__attribute__((visibility("default"))) void* cw_dfa_minimize(
    const int32_t* table, const uint8_t* final, int32_t n, int32_t start,
    int32_t* status) {
  try {
    Dfa* dfa = new Dfa(MinimizeTable(table, final, n, start));
    *status = kOk;
    return dfa;
  } catch (const Fail& f) {
    *status = f.status;
  } catch (const std::bad_alloc&) {
    *status = kNoMemory;
  } catch (const std::length_error&) {
    *status = kNoMemory;
  }
  return nullptr;
}

// `TokenDistance` (forced_ids, forced_end: null where none is forced).
__attribute__((visibility("default"))) void cw_token_distance(
    const int32_t* table, const uint8_t* final, int32_t n,
    const int64_t* keys, const int64_t* nodes, int64_t nkeys,
    const uint8_t* spells, const int32_t* forced_ids,
    const int32_t* forced_end, int32_t dead, int32_t* out) {
  TokenDistance(table, final, n, keys, nodes, nkeys, spells, forced_ids,
                forced_end, dead, out);
}

__attribute__((visibility("default"))) int32_t cw_regex_dfa_states(
    void* dfa) {
  return static_cast<Dfa*>(dfa)->n;
}

// Copies the table (int32[n, 256]) and the finals (uint8[n]).
__attribute__((visibility("default"))) void cw_regex_dfa_copy(
    void* dfa, int32_t* table, uint8_t* final) {
  Dfa* d = static_cast<Dfa*>(dfa);
  for (int64_t k = 0; k < d->n; ++k) {
    const int32_t* row = &d->table[k * d->nc];
    int32_t* to = &table[k * 256];
    for (int b = 0; b < 256; ++b) to[b] = row[d->cls[b]];
  }
  std::memcpy(final, d->final.data(), d->final.size());
}

__attribute__((visibility("default"))) void cw_regex_dfa_free(void* dfa) {
  delete static_cast<Dfa*>(dfa);
}

}  // extern "C"
