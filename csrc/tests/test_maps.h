// Maps shared by the C++ unit tests (no torch).
#pragma once

#include <math.h>

#include <algorithm>
#include <vector>

// bitsandbytes' dynamic map, rebuilt in C++ (fp32 means of a linspace, like create_dynamic_map; the exact
// values of the Python map are checked against bitsandbytes by the Python tests). Sorted, 256 values.
static std::vector<float> dynamic_map(bool is_signed) {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const float step = (1.0f - 0.1f) / (float)(items - 1);
    for (int j = 0; j + 1 < items; ++j) {
      const float lo = 0.1f + step * (float)j, hi = 0.1f + step * (float)(j + 1);
      const float mean = (lo + hi) / 2.0f * (float)pow(10.0, -6 + i);
      data.push_back(mean);
      if (is_signed) data.push_back(-mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  while (data.size() < 256) data.push_back(0.0f);
  std::sort(data.begin(), data.end());
  return data;
}

// A strictly increasing map crowded near 0.3 (many thresholds in one bucket: the search takes several steps),
// then spread to 1.
static std::vector<float> crowded_map() {
  std::vector<float> m(256);
  for (int j = 0; j < 256; ++j)
    m[j] = j < 200 ? 0.3f + 1e-6f * (float)(j - 100) : 0.3f + (float)(j - 199) / 56.0f * 0.7f;
  return m;
}
