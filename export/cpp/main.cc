// hla_tvm_app: greedy (or seeded sampled) generation with a module compiled by `hla-tvm
// compile`, linked against the TVM runtime alone (no compiler, no Python).
//
//   hla_tvm_app model.so --prompt 5,9,2,33 --steps 12 [--temperature T --top-k K --seed S]
//
// prints the generated token ids on one line, separated by spaces. The module's entry points:
//   prefill(tokens [1, T] int64, *state) -> (logits [1, T, vocab], *state)   (T >= 2)
//   decode(tokens [1] int64, *state)     -> (logits [1, vocab], *state)
// and hla_tvm_meta() -> uint8 JSON with the state layout ("state": [[name, shape, dtype]..]).
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/container/tensor.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;
using ffi::Tensor;

namespace {

struct Options {
  std::string module;
  std::vector<int64_t> prompt;
  int steps = 16;
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: every token
  uint64_t seed = 0;
};

[[noreturn]] void Usage(const std::string& why) {
  std::cerr << "hla_tvm_app: " << why << "\n"
            << "usage: hla_tvm_app MODEL.so --prompt 5,9,2 [--steps N] [--temperature T] "
               "[--top-k K] [--seed S]\n";
  std::exit(2);
}

// A whole decimal integer in [lo, hi], else the usage error naming `what`.
long long ParseInt(const std::string& text, const std::string& what, long long lo,
                   long long hi) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || v < lo || v > hi) {
    Usage(what + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
          "], got '" + text + "'");
  }
  return v;
}

std::vector<int64_t> ParseIds(const std::string& text) {
  std::vector<int64_t> ids;
  size_t start = 0;
  while (true) {   // (every item, a trailing empty one included, must be an id)
    size_t comma = text.find(',', start);
    ids.push_back(ParseInt(text.substr(start, comma - start), "each --prompt id", 0,
                           std::numeric_limits<int32_t>::max()));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ids;
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--prompt") {
      o.prompt = ParseIds(value());
    } else if (a == "--steps") {
      o.steps = static_cast<int>(ParseInt(value(), "--steps", 1, 1 << 24));
    } else if (a == "--temperature") {
      std::string t = value();
      char* end = nullptr;
      o.temperature = std::strtof(t.c_str(), &end);
      if (t.empty() || *end != '\0' || !std::isfinite(o.temperature) || o.temperature < 0) {
        Usage("--temperature must be a finite number >= 0, got '" + t + "'");
      }
    } else if (a == "--top-k") {
      o.top_k = static_cast<int>(ParseInt(value(), "--top-k", 0, 1 << 30));
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(ParseInt(value(), "--seed", 0,
                                              std::numeric_limits<long long>::max()));
    } else if (!a.empty() && a[0] == '-') {
      Usage("unknown option " + a);
    } else if (o.module.empty()) {
      o.module = a;
    } else {
      Usage("one module only");
    }
  }
  if (o.module.empty()) Usage("give the compiled module");
  if (o.prompt.empty()) Usage("give --prompt");
  return o;
}

// Host memory for tensors, 64-byte aligned (the kernels' vector loads expect it).
struct AlignedAlloc {
  void AllocData(DLTensor* t) {
    size_t bytes = (ffi::GetDataSize(*t) + 63) / 64 * 64;
    t->data = std::aligned_alloc(64, bytes ? bytes : 64);
    if (t->data == nullptr) throw std::bad_alloc();
    std::memset(t->data, 0, bytes);
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

Tensor Empty(const std::vector<int64_t>& shape, DLDataType dtype) {
  return Tensor::FromNDAlloc(AlignedAlloc(), ffi::Shape(shape), dtype, DLDevice{kDLCPU, 0});
}

DLDataType ParseDType(const std::string& s) {
  if (s == "float32") return DLDataType{kDLFloat, 32, 1};
  if (s == "float64") return DLDataType{kDLFloat, 64, 1};
  throw std::runtime_error("state dtype " + s + " is not supported by this app");
}

struct Model {
  ffi::Optional<ffi::Module> vm_;
  ffi::Function prefill, decode;
  std::vector<Tensor> state;
  bool has_prefill = false;
  int64_t vocab = 0;

  explicit Model(const std::string& path) {
    ffi::Module lib = ffi::Module::LoadFromFile(path);
    ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
    vm_ = vm;
    // one CPU device, pooled allocator (as tvm.relax.VirtualMachine does)
    vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, 2);
    Tensor raw = vm->GetFunction("hla_tvm_meta").value()().cast<Tensor>();
    std::string text(static_cast<const char*>(raw.data_ptr()) + raw.byte_offset(), raw.size(0));
    ffi::String error;
    ffi::json::Value parsed = ffi::json::Parse(text, &error);
    if (!error.empty()) throw std::runtime_error("module metadata: " + std::string(error));
    ffi::json::Object meta = parsed.cast<ffi::json::Object>();
    for (const ffi::Any& entry : meta.at("state").cast<ffi::json::Array>()) {
      auto e = entry.cast<ffi::json::Array>();
      std::vector<int64_t> shape{1};
      for (const ffi::Any& d : e[1].cast<ffi::json::Array>()) shape.push_back(d.cast<int64_t>());
      state.push_back(Empty(shape, ParseDType(e[2].cast<ffi::String>())));   // zeros
    }
    if (meta.count("vocab_size") && meta.at("vocab_size") != nullptr) {
      vocab = meta.at("vocab_size").cast<int64_t>();
    }
    decode = vm->GetFunction("decode").value();
    if (auto f = vm->GetFunction("prefill")) {
      prefill = *f;
      has_prefill = true;
    }
  }

  // Run `entry` on tokens (shape {1, T} or {1}); returns the logits of the last position.
  std::vector<float> Run(const ffi::Function& entry, const std::vector<int64_t>& tokens,
                         bool two_d) {
    std::vector<int64_t> shape = two_d ? std::vector<int64_t>{1, (int64_t)tokens.size()}
                                       : std::vector<int64_t>{1};
    Tensor tok = Empty(shape, DLDataType{kDLInt, 64, 1});
    std::memcpy(tok.data_ptr(), tokens.data(), tokens.size() * sizeof(int64_t));
    std::vector<ffi::AnyView> args;
    args.push_back(tok);
    for (const Tensor& s : state) args.push_back(s);
    ffi::Any result;
    entry.CallPacked(args.data(), static_cast<int32_t>(args.size()), &result);
    auto outs = result.cast<ffi::Array<ffi::Any>>();
    Tensor logits = outs[0].cast<Tensor>();
    DLDataType dt = logits.dtype();
    if (dt.code != kDLFloat || dt.bits != 32 || dt.lanes != 1 || !logits.IsContiguous()) {
      throw std::runtime_error("the module's logits are not contiguous float32");
    }
    for (size_t i = 0; i < state.size(); ++i) state[i] = outs[i + 1].cast<Tensor>();
    int64_t v = logits.size(logits.ndim() - 1);
    int64_t rows = 1;
    for (int i = 0; i < logits.ndim() - 1; ++i) rows *= logits.size(i);
    const float* data = reinterpret_cast<const float*>(
                            static_cast<const char*>(logits.data_ptr()) +
                            logits.byte_offset()) + (rows - 1) * v;
    return std::vector<float>(data, data + v);
  }

  std::vector<float> Prompt(const std::vector<int64_t>& ids) {
    if (has_prefill && ids.size() >= 2) return Run(prefill, ids, true);
    std::vector<float> last;
    for (int64_t id : ids) last = Run(decode, {id}, false);   // the prefill entry takes T >= 2
    return last;
  }
};

int64_t Pick(const std::vector<float>& logits, const Options& o, std::mt19937_64& rng) {
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  if (o.temperature == 0.0f) return static_cast<int64_t>(best);
  std::vector<size_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  size_t k = o.top_k > 0 ? std::min<size_t>(o.top_k, order.size()) : order.size();
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  std::vector<double> p(k);
  for (size_t i = 0; i < k; ++i) {
    p[i] = std::exp((logits[order[i]] - logits[best]) / o.temperature);
  }
  std::discrete_distribution<size_t> dist(p.begin(), p.end());
  return static_cast<int64_t>(order[dist(rng)]);
}

}  // namespace

int main(int argc, char** argv) {
  Options o = ParseArgs(argc, argv);
  try {
    Model m(o.module);
    for (int64_t id : o.prompt) {
      if (m.vocab && id >= m.vocab) Usage("prompt ids must lie below the vocabulary size");
    }
    std::mt19937_64 rng(o.seed);
    std::vector<int64_t> out;
    std::vector<float> logits = m.Prompt(o.prompt);
    for (int step = 0; step < o.steps; ++step) {
      int64_t next = Pick(logits, o, rng);
      out.push_back(next);
      if (step + 1 < o.steps) logits = m.Run(m.decode, {next}, false);
    }
    for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? " " : "") << out[i];
    std::cout << "\n";
  } catch (const std::exception& err) {
    std::cerr << "hla_tvm_app: " << err.what() << "\n";
    return 1;
  }
  return 0;
}
