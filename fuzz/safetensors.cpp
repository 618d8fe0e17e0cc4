// Fuzz target safetensors: the safetensors reader (formats/safetensors.*): the 8-byte length,
// the JSON header (duplicate keys, types, dtypes, shapes, offsets, overlap) and the tensors'
// placement. Bad input must end in FileError, never a crash.
#include <cstdint>

#include "base/error.h"
#include "formats/readers/safetensors.h"
#include "fuzz/fuzz_common.h"

using namespace llmq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file(data, size);
  try {
    auto f = SafetensorsFile::open(path);
    const uint8_t* base = f->mapping().data();
    unsigned sum = 0;
    for (const SafetensorsTensor& t : f->tensors()) {
      if (t.nbytes() == 0) continue;
      if (t.data < base || uint64_t(t.data - base) + t.nbytes() > f->mapping().size())
        fuzz::fail("tensor '" + t.name + "' outside the file");
      if (f->find(t.name) != &t) fuzz::fail("find('" + t.name + "') does not return the tensor");
      sum += t.data[0] + t.data[t.nbytes() - 1];  // touch both ends
      f->release(t.data, t.nbytes());
    }
    (void)sum;
  } catch (const FileError&) {
  }
  return 0;
}
