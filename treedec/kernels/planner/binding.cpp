// Python binding of the compiled planner: numpy arrays in and out through the CPython and numpy C APIs
// (pybind11's headers alone took 4x this file's build time). treedec/kernels/planner_build.py builds it;
// treedec/attention/planner_choice.py decides whether it runs.
//
// Results move into numpy arrays without a copy (a capsule owns each vector); the work runs with the
// GIL released, so a thread may plan the next step while Python runs.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <new>
#include <string>

#include "dynamic_span.h"
#include "make_plan.h"
#include "schedule.h"
#include "static_write.h"

using namespace treedec::planner;

namespace {

// An owned reference, released at scope exit.
struct Ref {
  PyObject* p = nullptr;
  Ref(PyObject* obj = nullptr) : p(obj) {}
  Ref(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
  PyObject* release() { PyObject* out = p; p = nullptr; return out; }
};

struct GilReleased {  // RAII for Py_BEGIN/END_ALLOW_THREADS, so that an exception restores the thread
  PyThreadState* state = PyEval_SaveThread();
  ~GilReleased() { PyEval_RestoreThread(state); }
};

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("compiled planner: " + what); }

// A C-contiguous array of `obj` with numpy dtype `typenum` (a copy only when it is not one already). The
// plan's own arrays are: they are taken as they are, without PyArray_FROMANY's checks (a step passes a dozen).
PyArrayObject* array_of(PyObject* obj, int typenum, int ndim, const char* name, Ref& holder) {
  if (PyArray_Check(obj)) {
    auto* a = reinterpret_cast<PyArrayObject*>(obj);
    if (PyArray_TYPE(a) == typenum && PyArray_NDIM(a) == ndim && PyArray_ISCARRAY_RO(a) && PyArray_ISNOTSWAPPED(a)) {
      return a;  // borrowed: the caller's arguments keep it alive
    }
  }
  holder.p = PyArray_FROMANY(obj, typenum, ndim, ndim, NPY_ARRAY_IN_ARRAY);
  if (holder.p == nullptr) {
    PyErr_Clear();
    fail(std::string(name) + " must be a " + std::to_string(ndim) + "-D integer array");
  }
  return reinterpret_cast<PyArrayObject*>(holder.p);
}

template <class T>
void free_vector(PyObject* capsule) {
  delete static_cast<std::vector<T>*>(PyCapsule_GetPointer(capsule, nullptr));
}

// `values` as a numpy array of `shape` (moved, not copied).
template <class T>
PyObject* to_numpy(std::vector<T>&& values, std::initializer_list<npy_intp> shape, int typenum) {
  std::vector<npy_intp> dims(shape);
  const int nd = static_cast<int>(dims.size());
  if (values.empty()) return PyArray_ZEROS(nd, dims.data(), typenum, 0);
  auto* owned = new std::vector<T>(std::move(values));
  Ref capsule(PyCapsule_New(owned, nullptr, free_vector<T>));
  if (capsule.p == nullptr) {
    delete owned;
    throw std::bad_alloc();
  }
  Ref array(PyArray_SimpleNewFromData(nd, dims.data(), typenum, owned->data()));
  if (array.p == nullptr || PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(array.p), capsule.release()) < 0) {
    throw std::bad_alloc();  // the capsule (stolen even on failure) frees the vector
  }
  return array.release();
}

PyObject* vec(Vec&& values) {
  const auto n = static_cast<npy_intp>(values.size());
  return to_numpy(std::move(values), {n}, NPY_INT64);
}

// Runs `body`, turning C++ exceptions into Python ones (invalid input: ValueError).
template <class Body>
PyObject* guarded(Body body) {
  try {
    return body();
  } catch (const std::invalid_argument& err) {
    PyErr_SetString(PyExc_ValueError, err.what());
  } catch (const std::bad_alloc&) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  return nullptr;
}

const i64* data64(PyArrayObject* a) { return static_cast<const i64*>(PyArray_DATA(a)); }

// make_plan(parent, kv_start, kv_slots, query_node, query_offset, planner, chunk_size, query_tile,
// num_kv_heads, num_sms, persistent_ctas, light_tile_cost, group_size, window, batch_invariant) -> (kv_slots or
// None where the layout's own serve, chunk_kv_start, chunk_entry_start, entry_query, entry_mask, query_entry_start,
// query_entries, entry_direct, item_chunk, item_entry_start, item_num_entries, chunk_size or None, max_slot)
PyObject* make_plan_py(PyObject*, PyObject* args) {
  PyObject *parent_obj, *kv_start_obj, *kv_slots_obj, *query_node_obj, *query_offset_obj;
  int planner;
  long long chunk_size, query_tile, num_kv_heads, num_sms, persistent_ctas, group_size, window;
  double light_tile_cost;
  int batch_invariant;
  if (!PyArg_ParseTuple(args, "OOOOOiLLLLLdLLp", &parent_obj, &kv_start_obj, &kv_slots_obj, &query_node_obj,
                        &query_offset_obj, &planner, &chunk_size, &query_tile, &num_kv_heads, &num_sms,
                        &persistent_ctas, &light_tile_cost, &group_size, &window, &batch_invariant)) {
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    Ref h_parent, h_start, h_slots, h_node, h_offset;
    PyArrayObject* parent = array_of(parent_obj, NPY_INT64, 1, "parent", h_parent);
    PyArrayObject* kv_start = array_of(kv_start_obj, NPY_INT64, 1, "kv_start", h_start);
    PyArrayObject* kv_slots = array_of(kv_slots_obj, NPY_INT64, 1, "kv_slots", h_slots);
    PyArrayObject* query_node = array_of(query_node_obj, NPY_INT64, 1, "query_node", h_node);
    PyArrayObject* query_offset = array_of(query_offset_obj, NPY_INT64, 1, "query_offset", h_offset);
    const i64 num_nodes = PyArray_DIM(parent, 0), num_queries = PyArray_DIM(query_node, 0);
    if (PyArray_DIM(kv_start, 0) != num_nodes + 1) fail("kv_start must have one more entry than parent");
    if (PyArray_DIM(query_offset, 0) != num_queries) fail("query_offset and query_node differ in length");
    if (num_queries == 0) fail("the layout has no queries");
    if (planner < kFlatten || planner > kPath || query_tile < 1 || num_kv_heads < 1 || num_sms < 1 || group_size < 1) {
      fail("the planner code or a size is out of range");
    }
    if (batch_invariant && (planner != kPath || chunk_size < 1)) {
      fail("batch_invariant plans need the path planner and a fixed chunk_size");
    }
    const LayoutView layout{data64(parent), data64(kv_start), data64(kv_slots), data64(query_node),
                            data64(query_offset), num_nodes, PyArray_DIM(kv_slots, 0), num_queries};
    const PlanOptions options{planner, chunk_size, query_tile, num_kv_heads, num_sms, persistent_ctas,
                              light_tile_cost, group_size, window, batch_invariant != 0};
    Plan plan;
    {
      GilReleased unlocked;
      plan = make_plan(layout, options);
    }
    PlanArrays& a = plan.arrays;
    const auto entries = static_cast<npy_intp>(a.entry_query.size());
    Ref slots(plan.layout_slots ? Py_NewRef(Py_None) : vec(std::move(plan.kv_slots)));
    Ref chunk(plan.chunk_size < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(plan.chunk_size));
    Ref parts[] = {vec(std::move(a.chunk_kv_start)), vec(std::move(a.chunk_entry_start)), vec(std::move(a.entry_query)),
                   to_numpy(std::move(a.entry_mask), {entries, static_cast<npy_intp>(a.mask_words)}, NPY_INT32),
                   vec(std::move(a.query_entry_start)), vec(std::move(a.query_entries)),
                   to_numpy(std::move(a.entry_direct), {entries}, NPY_BOOL), vec(std::move(a.item_chunk)),
                   vec(std::move(a.item_entry_start)), vec(std::move(a.item_num_entries))};
    return Py_BuildValue("(ONNNNNNNNNNOL)", slots.p, parts[0].release(), parts[1].release(), parts[2].release(),
                         parts[3].release(), parts[4].release(), parts[5].release(), parts[6].release(),
                         parts[7].release(), parts[8].release(), parts[9].release(), chunk.p,
                         static_cast<long long>(plan.max_slot));
  });
}

// schedule_units(item_chunk, item_entry_start, item_num_entries, chunk_kv_start, entry_mask, group,
// num_kv_heads, num_ctas, rows_per_unit, tile_tokens, dynamic_kv) -> (cta_unit_start, unit_info, tiles,
// cta_cost, device_array); dynamic_kv is TreePlan.dynamic_kv as an int64 [R, 2] array of (start, stop)
// ranges, checked here too (sorted, disjoint, inside the plan's tokens): live_tiles' search relies on it
PyObject* schedule_units_py(PyObject*, PyObject* args) {
  PyObject *chunk_obj, *start_obj, *count_obj, *kv_obj, *mask_obj, *dynamic_obj;
  long long group, num_kv_heads, num_ctas, rows_per_unit, tile_tokens;
  if (!PyArg_ParseTuple(args, "OOOOOLLLLLO", &chunk_obj, &start_obj, &count_obj, &kv_obj, &mask_obj, &group,
                        &num_kv_heads, &num_ctas, &rows_per_unit, &tile_tokens, &dynamic_obj)) {
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    Ref h_chunk, h_start, h_count, h_kv, h_mask, h_dynamic;
    PyArrayObject* item_chunk = array_of(chunk_obj, NPY_INT64, 1, "item_chunk", h_chunk);
    PyArrayObject* item_entry_start = array_of(start_obj, NPY_INT64, 1, "item_entry_start", h_start);
    PyArrayObject* item_num_entries = array_of(count_obj, NPY_INT64, 1, "item_num_entries", h_count);
    PyArrayObject* chunk_kv_start = array_of(kv_obj, NPY_INT64, 1, "chunk_kv_start", h_kv);
    PyArrayObject* entry_mask = array_of(mask_obj, NPY_INT32, 2, "entry_mask", h_mask);
    PyArrayObject* dynamic_kv = array_of(dynamic_obj, NPY_INT64, 2, "dynamic_kv", h_dynamic);
    const i64 items = PyArray_DIM(item_chunk, 0);
    if (PyArray_DIM(item_entry_start, 0) != items || PyArray_DIM(item_num_entries, 0) != items) {
      fail("the item arrays differ in length");
    }
    if (group < 1 || num_kv_heads < 1 || num_ctas < 1 || rows_per_unit < 1 || tile_tokens < kMaskBits ||
        tile_tokens % kMaskBits) {
      fail("a schedule size is out of range");
    }
    if (PyArray_DIM(dynamic_kv, 1) != 2) {
      fail("dynamic_kv must have shape [R, 2], got [" + std::to_string(PyArray_DIM(dynamic_kv, 0)) + ", " +
           std::to_string(PyArray_DIM(dynamic_kv, 1)) + "]");
    }
    const ScheduleInput in{data64(item_chunk), data64(item_entry_start), data64(item_num_entries),
                           data64(chunk_kv_start), static_cast<const std::int32_t*>(PyArray_DATA(entry_mask)), items,
                           PyArray_DIM(entry_mask, 1), data64(dynamic_kv), PyArray_DIM(dynamic_kv, 0)};
    const i64 num_entries = PyArray_DIM(entry_mask, 0), num_chunks = PyArray_DIM(chunk_kv_start, 0) - 1;
    const i64 num_tokens = num_chunks >= 0 ? in.chunk_kv_start[num_chunks] : 0;
    for (i64 r = 0; r < in.num_dynamic; ++r) {
      const i64 start = in.dynamic_kv[2 * r], stop = in.dynamic_kv[2 * r + 1];
      const auto range = [&] {
        return "dynamic_kv range " + std::to_string(r) + " [" + std::to_string(start) + ", " + std::to_string(stop) +
               ")";
      };
      if (start < 0 || stop <= start || stop > num_tokens) {
        fail(range() + " must have 0 <= start < stop <= num_tokens (" + std::to_string(num_tokens) + ")");
      }
      if (r > 0 && start < in.dynamic_kv[2 * r - 1]) {
        fail(range() + " must start at or after range " + std::to_string(r - 1) + "'s stop (" +
             std::to_string(in.dynamic_kv[2 * r - 1]) + ")");
      }
    }
    for (i64 i = 0; i < items; ++i) {  // every item's entries and chunk inside the arrays
      if (in.item_entry_start[i] < 0 || in.item_num_entries[i] < 0 ||
          in.item_entry_start[i] + in.item_num_entries[i] > num_entries || in.item_chunk[i] < 0 ||
          in.item_chunk[i] >= num_chunks) {
        fail("work item " + std::to_string(i) + " points outside the plan's arrays");
      }
    }
    Schedule s;
    {
      GilReleased unlocked;
      s = schedule_units(in, group, num_kv_heads, num_ctas, rows_per_unit, tile_tokens);
    }
    const auto units = static_cast<npy_intp>(s.unit_info.size() / kUnitFields);
    const auto tiles = static_cast<npy_intp>(s.tiles.size()), words = static_cast<npy_intp>(s.device.size());
    Ref parts[] = {to_numpy(std::move(s.cta_unit_start), {static_cast<npy_intp>(num_ctas + 1)}, NPY_INT32),
                   to_numpy(std::move(s.unit_info), {units, kUnitFields}, NPY_INT32),
                   to_numpy(std::move(s.tiles), {tiles}, NPY_INT32),
                   to_numpy(std::move(s.cta_cost), {static_cast<npy_intp>(num_ctas)}, NPY_FLOAT64),
                   to_numpy(std::move(s.device), {words}, NPY_INT32)};
    return Py_BuildValue("(NNNNN)", parts[0].release(), parts[1].release(), parts[2].release(), parts[3].release(),
                         parts[4].release());
  });
}

// stage_sections(host, sections) -> [(start, end), ...]: each section (values, offset, rows, cols, padding)
// written into the 1-D int32 array `host` (static_write.h); the word ranges to copy, coalesced.
PyObject* stage_sections_py(PyObject*, PyObject* args) {
  PyObject *host_obj, *sections_obj;
  if (!PyArg_ParseTuple(args, "OO", &host_obj, &sections_obj)) return nullptr;
  return guarded([&]() -> PyObject* {
    if (!PyArray_Check(host_obj) || PyArray_TYPE(reinterpret_cast<PyArrayObject*>(host_obj)) != NPY_INT32 ||
        PyArray_NDIM(reinterpret_cast<PyArrayObject*>(host_obj)) != 1 ||
        !PyArray_ISCARRAY(reinterpret_cast<PyArrayObject*>(host_obj))) {
      fail("host must be a writeable, contiguous 1-D int32 array");
    }
    auto* host_array = reinterpret_cast<PyArrayObject*>(host_obj);
    auto* host = static_cast<std::int32_t*>(PyArray_DATA(host_array));
    const i64 host_words = PyArray_DIM(host_array, 0);
    Ref sections(PySequence_Fast(sections_obj, "sections must be a sequence"));
    if (sections.p == nullptr) throw std::bad_alloc();
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(sections.p);
    std::vector<std::pair<i64, i64>> used;
    for (Py_ssize_t k = 0; k < count; ++k) {
      PyObject* values_obj;
      Section s;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(sections.p, k), "OLLLi", &values_obj, &s.offset, &s.rows,
                            &s.cols, &s.padding)) {
        PyErr_Clear();
        fail("section " + std::to_string(k) + " must be (values, offset, rows, cols, padding)");
      }
      Ref holder;
      PyArrayObject* values = nullptr;
      const int ndim = s.cols == 0 ? 1 : 2;
      if (PyArray_Check(values_obj)) {  // the plan's arrays: int64, int32 (the mask) or bool, contiguous
        auto* a = reinterpret_cast<PyArrayObject*>(values_obj);
        const int type = PyArray_TYPE(a);
        if ((type == NPY_INT64 || type == NPY_INT32 || type == NPY_BOOL) && PyArray_NDIM(a) == ndim &&
            PyArray_ISCARRAY_RO(a) && PyArray_ISNOTSWAPPED(a)) {
          values = a;  // borrowed: `sections` keeps it alive
        }
      }
      if (values == nullptr) {
        holder.p = PyArray_FROMANY(values_obj, NPY_INT64, ndim, ndim, NPY_ARRAY_IN_ARRAY);
        if (holder.p == nullptr) {
          PyErr_Clear();
          fail("section " + std::to_string(k) + "'s values must be a " + std::to_string(ndim) + "-D integer array");
        }
        values = reinterpret_cast<PyArrayObject*>(holder.p);
      }
      s.value_rows = PyArray_DIM(values, 0);
      s.value_cols = ndim == 2 ? PyArray_DIM(values, 1) : 0;
      const bool fits = s.value_rows <= s.rows && s.value_cols <= s.cols && s.offset >= 0 &&
                        s.offset + s.rows * std::max<i64>(s.cols, 1) <= host_words;
      const bool padding_ok = s.padding == kPrefix || (ndim == 1 ? s.padding == kZeros || s.padding == kEdge
                                                                   : s.padding == kZeroTails);
      if (!fits || !padding_ok) {
        fail("section " + std::to_string(k) + " does not fit its place in the buffer, or has a bad padding");
      }
      const void* data = PyArray_DATA(values);
      switch (PyArray_TYPE(values)) {
        case NPY_INT64:
          used.push_back(write_section(host, s, [p = static_cast<const i64*>(data)](i64 i) { return p[i]; }));
          break;
        case NPY_INT32:
          used.push_back(write_section(host, s, [p = static_cast<const std::int32_t*>(data)](i64 i) { return p[i]; }));
          break;
        default:  // NPY_BOOL
          used.push_back(write_section(host, s, [p = static_cast<const std::uint8_t*>(data)](i64 i) { return p[i]; }));
      }
    }
    const std::vector<std::pair<i64, i64>> ranges = coalesce(std::move(used));
    Ref out(PyList_New(static_cast<Py_ssize_t>(ranges.size())));
    if (out.p == nullptr) throw std::bad_alloc();
    for (size_t k = 0; k < ranges.size(); ++k) {
      PyObject* pair = Py_BuildValue("(LL)", static_cast<long long>(ranges[k].first),
                                     static_cast<long long>(ranges[k].second));
      if (pair == nullptr) throw std::bad_alloc();
      PyList_SET_ITEM(out.p, static_cast<Py_ssize_t>(k), pair);
    }
    return out.release();
  });
}

// span_places(layout_kv, plan_kv, slots, lengths) -> (position, span, slot, ranges [P, 2], bad): DynamicSpans.places
// of a plan and the runs DynamicSpans.locate makes of them (dynamic_span.h); bad: the first span whose slots are not
// one run of the tree's KV (-1: none; the caller words the error)
PyObject* span_places_py(PyObject*, PyObject* args) {
  PyObject *layout_obj, *plan_obj, *slots_obj, *lengths_obj;
  if (!PyArg_ParseTuple(args, "OOOO", &layout_obj, &plan_obj, &slots_obj, &lengths_obj)) return nullptr;
  return guarded([&]() -> PyObject* {
    Ref h_layout, h_plan, h_slots, h_lengths;
    PyArrayObject* layout_kv = array_of(layout_obj, NPY_INT64, 1, "layout_kv", h_layout);
    PyArrayObject* plan_kv = array_of(plan_obj, NPY_INT64, 1, "plan_kv", h_plan);
    PyArrayObject* slots = array_of(slots_obj, NPY_INT64, 1, "slots", h_slots);
    PyArrayObject* lengths = array_of(lengths_obj, NPY_INT64, 1, "lengths", h_lengths);
    const i64 num_spans = PyArray_DIM(lengths, 0), num_slots = PyArray_DIM(slots, 0);
    i64 total = 0;
    for (i64 i = 0; i < num_spans; ++i) {
      if (data64(lengths)[i] < 0) fail("a span's length is negative");
      total += data64(lengths)[i];
    }
    if (total != num_slots || num_slots >= (i64(1) << 31)) fail("the spans' lengths do not sum to their slots");
    SpanPlaces s;
    {
      GilReleased unlocked;
      s = span_places(data64(layout_kv), PyArray_DIM(layout_kv, 0), data64(plan_kv), PyArray_DIM(plan_kv, 0),
                      data64(slots), num_slots, data64(lengths), num_spans);
    }
    const auto runs = static_cast<npy_intp>(s.ranges.size() / 2);
    Ref parts[] = {vec(std::move(s.position)), vec(std::move(s.span)), vec(std::move(s.slot)),
                   to_numpy(std::move(s.ranges), {runs, 2}, NPY_INT64)};
    return Py_BuildValue("(NNNNL)", parts[0].release(), parts[1].release(), parts[2].release(), parts[3].release(),
                         static_cast<long long>(s.bad));
  });
}

// mask_patch(chunk_kv_start, chunk_entry_start, position, span, slot, lengths, stride) -> (flat, words, table,
// merged): MaskPatch.of's arrays for the spans at their places, in one int64 array (dynamic_span.h says their
// order); words -1: no place
PyObject* mask_patch_py(PyObject*, PyObject* args) {
  PyObject *kv_obj, *entry_obj, *position_obj, *span_obj, *slot_obj, *lengths_obj;
  long long stride;
  if (!PyArg_ParseTuple(args, "OOOOOOL", &kv_obj, &entry_obj, &position_obj, &span_obj, &slot_obj, &lengths_obj,
                        &stride)) {
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    Ref h_kv, h_entry, h_position, h_span, h_slot, h_lengths;
    PyArrayObject* chunk_kv_start = array_of(kv_obj, NPY_INT64, 1, "chunk_kv_start", h_kv);
    PyArrayObject* chunk_entry_start = array_of(entry_obj, NPY_INT64, 1, "chunk_entry_start", h_entry);
    PyArrayObject* position = array_of(position_obj, NPY_INT64, 1, "position", h_position);
    PyArrayObject* span = array_of(span_obj, NPY_INT64, 1, "span", h_span);
    PyArrayObject* slot = array_of(slot_obj, NPY_INT64, 1, "slot", h_slot);
    PyArrayObject* lengths = array_of(lengths_obj, NPY_INT64, 1, "lengths", h_lengths);
    const i64 num_chunks = PyArray_DIM(chunk_kv_start, 0) - 1, num_places = PyArray_DIM(position, 0);
    if (num_chunks < 0 || PyArray_DIM(chunk_entry_start, 0) != num_chunks + 1) {
      fail("chunk_kv_start and chunk_entry_start must hold one more entry than the plan's chunks");
    }
    if (PyArray_DIM(span, 0) != num_places || PyArray_DIM(slot, 0) != num_places || stride < 1) {
      fail("position, span and slot must hold one value a place, stride >= 1");
    }
    Patch p;
    {
      GilReleased unlocked;
      p = mask_patch(data64(chunk_kv_start), num_chunks, data64(chunk_entry_start), data64(position), data64(span),
                     data64(slot), num_places, data64(lengths), PyArray_DIM(lengths, 0), stride);
    }
    return Py_BuildValue("(NLLL)", vec(std::move(p.flat)), static_cast<long long>(p.words),
                         static_cast<long long>(p.table), static_cast<long long>(p.merged));
  });
}

// The numpy planner's constants as compiled in (tests/kernels/test_compiled_planner.py checks that they agree).
PyObject* constants_py(PyObject*, PyObject*) {
  return Py_BuildValue("{sLsLsLsLsdsLsLsdsdsdsdsisisisL}", "MASK_BITS", (long long)kMaskBits, "PERSISTENT_MIN_CHUNK",
                       (long long)kPersistentMinChunk, "PERSISTENT_MAX_CHUNK", (long long)kPersistentMaxChunk,
                       "PERSISTENT_REFINE_CHUNK", (long long)kPersistentRefineChunk, "BALANCED_MIN_GAIN",
                       kBalancedMinGain, "TILE_TOKENS", (long long)kTileTokens, "MAX_QUERY_TILE_PAIRS",
                       (long long)kMaxQueryTilePairs, "SPLIT_UNIT_COST", kSplitUnitCost, "COST_PER_ROW", kCostPerRow,
                       "COST_PER_KV_TOKEN", kCostPerKvToken, "COST_PER_UNIT", kCostPerUnit, "FULL_TILE_FLAG",
                       static_cast<int>(kFullTileFlag), "UNIT_FIELDS", kUnitFields, "SCHEDULE_HEADER", kScheduleHeader,
                       "COALESCE_GAP", static_cast<long long>(kCoalesceGap));
}

PyMethodDef methods[] = {
    {"make_plan", make_plan_py, METH_VARARGS, "planners.make_plan's arrays for a TreeLayout's arrays"},
    {"schedule_units", schedule_units_py, METH_VARARGS, "persistent_schedule.schedule_units's arrays for a TreePlan's"},
    {"stage_sections", stage_sections_py, METH_VARARGS, "a static plan's sections written into its host buffer"},
    {"span_places", span_places_py, METH_VARARGS, "dynamic_span.DynamicSpans.places and the runs locate makes"},
    {"mask_patch", mask_patch_py, METH_VARARGS, "dynamic_span.MaskPatch.of's arrays in one int64 array"},
    {"constants", constants_py, METH_NOARGS, "the numpy planner's constants as compiled in"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, nullptr, "treedec's compiled planner (make_plan, schedule_units)",
                          -1, methods};

}  // namespace

#define TREEDEC_CONCAT_(a, b) a##b
#define TREEDEC_CONCAT(a, b) TREEDEC_CONCAT_(a, b)
#define TREEDEC_STRING_(a) #a
#define TREEDEC_STRING(a) TREEDEC_STRING_(a)

PyMODINIT_FUNC TREEDEC_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  import_array();  // numpy's C API (returns NULL with an ImportError set on failure)
  module_def.m_name = TREEDEC_STRING(TORCH_EXTENSION_NAME);
  return PyModule_Create(&module_def);
}
